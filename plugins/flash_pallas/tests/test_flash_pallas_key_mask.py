"""Key masks reach flash_pallas as segment ids (docs/DESIGN.md, section 4), in interpret mode.

The suite's ``key_mask`` family runs through the registry, so flash_pallas is
handed the rewritten call; the cases kept here span several of its 128-key
blocks (300 keys), hold an example that sees no key, and combine the rewrite
with segment ids of the call's own, forward and gradients vs the float64 oracle.
"""

from __future__ import annotations

import json

from attn_backend_flash_pallas import FlashPallasBackend, interpret_mode


def test_the_key_mask_family_passes_through_the_rewrite(tmp_path, monkeypatch):
    from attn_backends_contracts import run_check

    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    with interpret_mode():
        code = run_check(FlashPallasBackend(), str(tmp_path / "cert.json"),
                         ["--attn-only", "key_mask", "-k", "q130k300 or decode or segments",
                          "-q", "-p", "no:cacheprovider"])
    cert = json.loads((tmp_path / "cert.json").read_text())
    assert code == 0, cert["failures"]
    # float32: three cases and the tiles twins of the two over 128 keys; bfloat16:
    # the two of the dtype sweep. Forward and gradients each.
    assert cert["families"]["key_mask"] == {"float32": {"passed": 10},
                                            "bfloat16": {"passed": 4}}
