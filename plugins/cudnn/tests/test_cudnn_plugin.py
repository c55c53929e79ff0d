"""cudnn without cuDNN: packaging, manifest, check() refusals, ranking on gpu.

These run everywhere. Numerics need a GPU (test_cudnn_gpu.py); the mapping is
checked through jax.nn's XLA implementation (test_cudnn_mapping.py).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import attn_backend_cudnn._plugin as plugin
import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_cudnn import CudnnBackend
from attn_backends.contract import jax_api

BACKEND = CudnnBackend()


def _bind(b=1, tq=8, tk=8, hq=4, hkv=2, d=64, dv=None, dtype="bfloat16", **kw):
    q = jnp.zeros((b, tq, hq, d), dtype)
    k = jnp.zeros((b, tk, hkv, d), dtype)
    v = jnp.zeros((b, tk, hkv, dv or d), dtype)
    call, operands = attn_backends.bind(q, k, v, **kw)
    return call, operands, (q, k, v)


@pytest.fixture
def cudnn_present(monkeypatch):
    """Pretend JAX found cuDNN 9.10 (and, unless set again, no local GPU)."""
    monkeypatch.setattr(plugin, "cudnn_version", lambda: 91000)
    monkeypatch.setattr(plugin, "local_compute_capability", lambda: None)


def test_entry_point_and_identity():
    eps = importlib.metadata.entry_points(group=attn_backends.ENTRY_POINT_GROUP)
    (ep,) = [e for e in eps if e.name == "cudnn"]
    assert ep.value == "attn_backend_cudnn._plugin"
    assert ep.dist.name == "attn-backend-cudnn"
    (backend,) = ep.load().attn_backends_register()
    assert backend.name == "cudnn" and backend.version == ep.dist.version
    assert backend.priority == {"gpu": 100}
    assert backend.hlo_marker == "__cudnn$fmha"
    assert backend.capabilities.jax_versions == ">=0.10,<0.13"


def test_listing_does_not_import_the_adapter():
    code = (
        "import sys, attn_backend_cudnn._plugin as p; p.attn_backends_register(); "
        "print('attn_backend_cudnn._adapter' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_manifest():
    caps = CudnnBackend.capabilities
    assert caps.platforms == {"gpu"}
    assert caps.dtypes == {"bfloat16", "float16"}
    assert caps.features == {"gqa", "causal", "window", "segment_ids", "lengths", "mask", "bias"}
    assert not caps.bias_grad and not caps.softcap and not caps.return_lse
    assert caps.differentiable and not caps.deterministic
    assert caps.head_dims.reasons(8, "d") == caps.head_dims.reasons(256, "d") == []
    assert caps.head_dims.reasons(12, "d") and caps.head_dims.reasons(264, "d")


def test_without_cudnn_check_says_how_to_install(monkeypatch):
    monkeypatch.setattr(plugin, "cudnn_version", lambda: None)
    call, _, _ = _bind()
    (reason,) = BACKEND.check(call)
    assert "cuDNN not found" in reason and "attn-backend-cudnn[cuda]" in reason


@pytest.mark.parametrize(
    "capability, kw, word",
    [
        (None, dict(dv=32), "v_head_dim=32"),
        (None, dict(bias=np.zeros((1, 1, 8, 8), np.float32)), "bias dtype float32"),
        (None, dict(d=192), "none is visible here"),
        ((8, 0), dict(d=256), "this GPU has 8.0"),
    ],
)
def test_check_declines(cudnn_present, monkeypatch, capability, kw, word):
    monkeypatch.setattr(plugin, "local_compute_capability", lambda: capability)
    call, operands, (q, k, v) = _bind(**kw)
    assert any(word in r for r in BACKEND.check(call))
    with pytest.raises(attn_backends.UnsupportedError, match=word):
        BACKEND.attend(call, q, k, v, operands)


def test_hopper_serves_large_head_dims(cudnn_present, monkeypatch):
    monkeypatch.setattr(plugin, "local_compute_capability", lambda: (9, 0))
    call, _, _ = _bind(d=256)
    assert BACKEND.check(call) == []


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(dtype="float32"), "float32"),
        (dict(softcap=5.0), "softcap"),
        (dict(return_lse=True), "return_lse"),
        (dict(d=12), "head_dim=12"),
    ],
)
def test_core_refuses_the_unclaimed_before_attend(cudnn_present, monkeypatch, kw, word):
    """The manifest alone excludes these (attend keeps no copy of it): selection
    for gpu refuses them, on a machine with or without one."""
    dtype, d = kw.pop("dtype", "bfloat16"), kw.pop("d", 64)
    q = jnp.zeros((1, 8, 4, d), dtype)
    kv = jnp.zeros((1, 8, 2, d), dtype)

    def attend(*args, **kwargs):
        raise AssertionError("core handed attend a call the manifest excludes")

    monkeypatch.setattr(CudnnBackend, "attend", attend)
    registry = attn_backends.Registry(only=["cudnn"], probe=None)
    attention = registry.get(device="gpu", backend="cudnn")
    with pytest.raises(attn_backends.UnsupportedError, match=word):
        jax.eval_shape(lambda q, k, v: attention(q, k, v, **kw), q, kv, kv)


def _gpu_explain(*extra, **kw):
    registry = attn_backends.Registry(
        only=["cudnn", "flash_triton", "xla_native", "reference", *extra])
    q = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    return registry.get(device="gpu").explain(q, k, k, **kw)


def test_gpu_ranking_cudnn_then_flash_triton_then_xla_native(cudnn_present):
    explanation = _gpu_explain(causal=True)
    assert explanation.chosen == "cudnn"
    ranked = [v.backend for v in explanation.verdicts]
    assert ranked[:2] == ["cudnn", "flash_triton"]
    if "xla_native" in ranked:  # not installed in the second jax line's environment
        assert ranked[2] == "xla_native"
    # softcap: neither GPU kernel takes it, and explain names it for both.
    explanation = _gpu_explain(softcap=5.0)
    assert explanation.chosen in ("xla_native", "reference")
    text = str(explanation)
    assert text.count("softcap") >= 2


def test_without_cudnn_gpu_selection_falls_to_the_fused_triton_kernel(monkeypatch):
    """flash_triton where its kernel is (jax < 0.12), else tokamax_triton."""
    monkeypatch.setattr(plugin, "cudnn_version", lambda: None)
    explanation = _gpu_explain("tokamax_triton", causal=True)
    gone = jax_api.pallas_triton_ops_gone()
    assert explanation.chosen == ("tokamax_triton" if gone else "flash_triton")
    assert "cuDNN not found" in str(explanation)
