"""The suite and the probe judge tokamax's code: tokamax's ``xla`` implementation,
patched here (monkeypatch, in this process only; tokamax's files are untouched)
to be wrong in one small way, fails certification on the family that shows it
and is quarantined by the runtime probe, the reason naming the tokamax backend.

Each certification runs the quick table of one or two families in-process
(``run_check`` on a Backend instance); jit caches are cleared around each
patch, so no program traced from the unpatched code is reused.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from attn_backend_tokamax import TokamaxXlaBackend
from attn_backend_tokamax._environment import import_tokamax
from attn_backends_contracts import run_check

import_tokamax()
from tokamax._src.ops.attention import base  # noqa: E402 (after absl's flags are handled)

QUICK = ["--attn-quick", "-q", "-p", "no:cacheprovider"]


def _wrong_fwd(**changes):
    """DotProductAttention._fwd (tokamax's ``xla``) with keyword arguments changed."""
    right = base.DotProductAttention._fwd

    @functools.wraps(right)
    def wrong(self, *args, **kwargs):
        for name, change in changes.items():
            if kwargs.get(name) is not None:
                kwargs[name] = change(kwargs[name])
        return right(self, *args, **kwargs)

    return wrong


def _causal_one_late(right):
    """Mask.as_array with causal rows seeing one key past the diagonal (tokamax
    0.0.17's Mask holds a CausalMask, whose offset moves; 0.0.12's a flag)."""

    @functools.wraps(right)
    def wrong(self, q_len_or_indices, k_len_or_indices):
        import dataclasses

        causal = getattr(self, "causal_mask", None)
        if causal is not None:
            late = dataclasses.replace(causal, offset=causal.offset + 1)
            return right(dataclasses.replace(self, causal_mask=late), q_len_or_indices,
                         k_len_or_indices)
        if not self.is_causal:
            return right(self, q_len_or_indices, k_len_or_indices)

        rest = right(dataclasses.replace(self, is_causal=False), q_len_or_indices,
                     k_len_or_indices)
        i = jnp.arange(q_len_or_indices)[:, None]
        band = i + 1 >= jnp.arange(k_len_or_indices)[None, :]
        return band if rest is None else rest & band

    return wrong


#: name -> (what is patched, the attribute's replacement, the family that must fail)
MUTANTS = {
    "scale": (base.DotProductAttention, "_fwd", _wrong_fwd(logits_scale=lambda s: s * 1.05),
              "shapes"),
    "causal_offset": (base.Mask, "as_array", _causal_one_late(base.Mask.as_array), "causal"),
    "softcap": (base.DotProductAttention, "_fwd", _wrong_fwd(logits_soft_cap=lambda c: c * 1.1),
                "softcap"),
}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A cache folder of this test's own (no certificate, no quarantine kept), and
    jit caches cleared before and after."""
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    jax.clear_caches()
    yield monkeypatch
    jax.clear_caches()


def _certify(tmp_path: Path, families: str) -> dict:
    path = tmp_path / "certificate.json"
    run_check(TokamaxXlaBackend(), str(path), [*QUICK, f"--attn-only={families}"])
    return json.loads(path.read_text())


def test_unpatched_tokamax_passes_those_families(fresh, tmp_path):
    cert = _certify(tmp_path, "shapes,causal,softcap")
    assert cert["passed"], cert["failures"]


@pytest.mark.parametrize("name", list(MUTANTS))
def test_patched_tokamax_fails_certification(fresh, tmp_path, name):
    owner, attribute, wrong, family = MUTANTS[name]
    fresh.setattr(owner, attribute, wrong)
    cert = _certify(tmp_path, family)
    assert not cert["passed"]
    assert family in {f["family"] for f in cert["failures"]}
    assert all("differs" in f["message"] or "max" in f["message"] for f in cert["failures"])


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "scale"])
def test_the_probe_quarantines_patched_tokamax_naming_it(fresh, patched):
    if patched:
        owner, attribute, wrong, _ = MUTANTS["scale"]
        fresh.setattr(owner, attribute, wrong)
    q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 32), jnp.float32)
    registry = ab.Registry(only=["tokamax_xla", "reference"])
    explanation = registry.get(device="cpu").explain(q, kv, kv, causal=True)
    (verdict,) = [v for v in explanation.verdicts if v.backend == "tokamax_xla"]
    assert verdict.probed is True
    if not patched:
        assert explanation.chosen == "tokamax_xla" and verdict.accepted
        return
    assert explanation.chosen == "reference" and not verdict.accepted
    assert verdict.reasons and all(
        r.startswith("probe") and "differs from the float64 oracle" in r for r in verdict.reasons)
    text = str(explanation)
    assert "tokamax_xla" in text and "differs from the float64 oracle" in text
