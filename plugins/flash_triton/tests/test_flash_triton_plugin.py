"""flash_triton without running a kernel: packaging, manifest, switch, config, refusals."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys

import attn_backends
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_flash_triton import (
    ENV_VAR,
    FlashTritonBackend,
    TritonBlockSizes,
    interpret_enabled,
    interpret_mode,
)
from attn_backends.contract import jax_api

BACKEND = FlashTritonBackend()
#: Why flash_triton is refused on this jax (None: its kernel is there, jax < 0.12).
GONE = jax_api.pallas_triton_ops_gone()


@pytest.fixture
def switch_off(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _bind(b=1, tq=8, tk=8, hq=2, hkv=1, d=64, dv=None, dtype="float32", **kw):
    q = jnp.zeros((b, tq, hq, d), dtype)
    k = jnp.zeros((b, tk, hkv, d), dtype)
    v = jnp.zeros((b, tk, hkv, dv or d), dtype)
    call, operands = attn_backends.bind(q, k, v, **kw)
    return call, operands, (q, k, v)


def test_entry_point_and_identity():
    eps = importlib.metadata.entry_points(group=attn_backends.ENTRY_POINT_GROUP)
    (ep,) = [e for e in eps if e.name == "flash_triton"]
    assert ep.value == "attn_backend_flash_triton._plugin"
    assert ep.dist.name == "attn-backend-flash-triton"
    (backend,) = ep.load().attn_backends_register()
    assert backend.name == "flash_triton" and backend.version == ep.dist.version
    assert backend.priority == {"gpu": 80, "cpu": 10}
    assert backend.hlo_marker == "mha_forward"
    assert backend.capabilities.jax_versions == ">=0.10,<0.13"


def test_import_does_not_import_the_kernel():
    code = (
        "import sys, attn_backend_flash_triton._plugin as p; p.attn_backends_register(); "
        "print(any('pallas' in m for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_manifest_claims_exactly_the_certified_features(switch_off):
    caps = FlashTritonBackend.capabilities
    assert caps.features == {"gqa", "causal"}
    assert caps.platforms == {"gpu"}
    assert caps.dtypes == {"float32", "bfloat16", "float16"}
    assert caps.differentiable and caps.deterministic and caps.interpret
    assert not caps.bias_grad and not caps.return_lse and not caps.partitionable
    assert caps.head_dims.reasons(16, "d") == caps.head_dims.reasons(128, "d") == []
    assert caps.head_dims.reasons(8, "d") and caps.head_dims.reasons(256, "d")


def test_cpu_needs_the_switch(switch_off, monkeypatch):
    call, _, _ = _bind()
    assert not interpret_enabled()
    reasons = BACKEND.capabilities.unmet(call, "cpu")
    assert len(reasons) == 1 and ENV_VAR in reasons[0] and "interpret_mode()" in reasons[0]
    assert BACKEND.capabilities.unmet(call, "gpu") == []
    with interpret_mode():
        assert BACKEND.capabilities.platforms == {"gpu", "cpu"}
        assert BACKEND.capabilities.unmet(call, "cpu") == []
        with interpret_mode(False):
            assert BACKEND.capabilities.platforms == {"gpu"}
    monkeypatch.setenv(ENV_VAR, "1")
    assert FlashTritonBackend.capabilities.platforms == {"gpu", "cpu"}
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=ENV_VAR):
        interpret_enabled()


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(tq=8, tk=16), "Tq=8 != Tk=16"),
        (dict(tq=16, tk=8, causal=True), "Tq=16 != Tk=8"),
        (dict(dv=32), "v_head_dim=32"),
    ],
)
def test_check_declines_what_the_kernel_cannot(kw, word):
    call, operands, (q, k, v) = _bind(**kw)
    assert any(word in r for r in BACKEND.check(call))
    with pytest.raises(attn_backends.UnsupportedError, match=word):
        BACKEND.attend(call, q, k, v, operands)


@pytest.mark.parametrize(
    "kw, feature",
    [
        (dict(window=(2, 0)), "window"),
        (dict(segment_ids=(np.zeros((1, 8), np.int32),) * 2), "segment_ids"),
        (dict(kv_lengths=np.array([4], np.int32)), "lengths"),
        (dict(mask=np.ones((1, 1, 8, 8), bool)), "mask"),
        (dict(bias=np.zeros((1, 1, 8, 8), np.float32)), "bias"),
        (dict(softcap=5.0), "softcap"),
        (dict(return_lse=True), "return_lse"),
    ],
)
def test_core_refuses_unclaimed_features_before_attend(monkeypatch, kw, feature):
    call, _, (q, k, v) = _bind(**kw)
    attended = []
    monkeypatch.setattr(FlashTritonBackend, "attend", lambda *args, **kw: attended.append(args))
    with interpret_mode():
        attention = attn_backends.Registry(only=["flash_triton"], probe=None).get(
            device="cpu", backend="flash_triton")
        with pytest.raises(attn_backends.UnsupportedError, match=f"feature '{feature}'"):
            attention(q, k, v, **kw)
    assert attended == [] and BACKEND.check(call) == ([GONE] if GONE else [])


def test_gpu_explain_ranks_flash_triton_over_the_plain_jax_backends():
    registry = attn_backends.Registry(only=["flash_triton", "xla_native", "reference"])
    q = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    explanation = registry.get(device="gpu").explain(q, k, k, causal=True)
    if GONE:
        # jax >= 0.12: refused by check() before it is chosen, with the reason.
        assert explanation.chosen == "xla_native"
        assert GONE in str(explanation) and "removed in 0.12.1" in GONE
        return
    assert explanation.chosen == "flash_triton"
    # A call it cannot serve goes on down the list (xla_native where installed,
    # else reference), and explain says why.
    explanation = registry.get(device="gpu").explain(q, k, k, window=(8, 0))
    assert explanation.chosen in ("xla_native", "reference")
    assert "window" in str(explanation)


def test_block_sizes_validate_themselves():
    with pytest.raises(ValueError, match="block_q=8"):
        TritonBlockSizes(block_q=8)
    with pytest.raises(ValueError, match="power of two"):
        TritonBlockSizes(block_k=48)
    with pytest.raises(ValueError, match="block_q_dq"):
        TritonBlockSizes(block_q_dq=64)
    with pytest.raises(ValueError, match="num_warps"):
        TritonBlockSizes(num_warps=3)
    blocks = TritonBlockSizes()
    assert blocks.multiple == 128 and blocks.padded(129) == 256 and blocks.padded(128) == 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks.block_q = 64  # type: ignore[misc]


def test_defaults_shrink_for_short_sequences_and_tiles_are_smallest():
    long_call, _, _ = _bind(tq=4096, tk=4096)
    gpu = TritonBlockSizes.default_for(long_call)
    assert (gpu.block_q, gpu.block_k, gpu.block_q_dkv) == (128, 128, 32)
    short_call, _, _ = _bind(tq=20, tk=20)
    assert TritonBlockSizes.default_for(short_call).block_q == 32
    assert TritonBlockSizes.default_for(long_call, interpret=True).multiple == 16
    with interpret_mode(False):
        tiles = BACKEND.tile_small_options(long_call)
        assert tiles is not None and tiles.multiple == 16
    with interpret_mode():
        assert BACKEND.tile_small_options(long_call) is None  # the default already is
    with pytest.raises(ValueError, match="TritonBlockSizes"):
        from attn_backend_flash_triton._adapter import resolve_blocks

        resolve_blocks(long_call, {"block_q": 64}, False)
