"""The "Many chips" examples (docs/MANY_CHIPS.md, the guide docs/guides/many-chips.md) run as
written, in fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _docs import FENCE, ROOT, code_blocks


def _many_chips_example(doc: str) -> str:
    # MANY_CHIPS.md's "Many hosts" shows a launch on a pod, which needs its hosts
    blocks = code_blocks(doc) if doc.endswith("many-chips.md") else \
        FENCE.findall((ROOT / doc).read_text().split("\n## Many hosts", 1)[0])
    assert len(blocks) == 1, f"{doc}: the 'Many chips' part has one runnable example"
    return blocks[0]


@pytest.mark.parametrize("doc", ["docs/MANY_CHIPS.md", "docs/guides/many-chips.md"])
def test_many_chips_example_runs(tmp_path, doc):
    script = tmp_path / "many_chips_example.py"
    script.write_text(_many_chips_example(doc))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ATTN_BACKENDS_CACHE_DIR": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    env.pop("ATTN_BACKENDS_PALLAS_INTERPRET", None)
    # Every warning an error.
    done = subprocess.run([sys.executable, "-W", "error", str(script)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sequence over sp (4): ring" in done.stdout
