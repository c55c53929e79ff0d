"""flash_pallas without running a kernel: packaging, manifest, switch, config, refusals."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys

import attn_backends
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_flash_pallas import (
    ENV_VAR,
    FlashPallasBackend,
    SplashBlockSizes,
    _masks,
    interpret_enabled,
    interpret_mode,
)
from attn_backend_flash_pallas._config import generation

BACKEND = FlashPallasBackend()


@pytest.fixture
def flash_pallas_env_off(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _bind(b=1, tq=8, tk=8, hq=2, hkv=1, d=64, dtype="float32", **kw):
    q = jnp.zeros((b, tq, hq, d), dtype)
    k = jnp.zeros((b, tk, hkv, d), dtype)
    call, operands = attn_backends.bind(q, k, k, **kw)
    return call, operands, (q, k, k)


def test_entry_point_and_identity():
    eps = importlib.metadata.entry_points(group=attn_backends.ENTRY_POINT_GROUP)
    (ep,) = [e for e in eps if e.name == "flash_pallas"]
    assert ep.value == "attn_backend_flash_pallas._plugin"
    assert ep.dist.name == "attn-backend-flash-pallas"
    (backend,) = ep.load().attn_backends_register()
    assert backend.name == "flash_pallas" and backend.version == ep.dist.version
    assert backend.priority == {"tpu": 100, "cpu": 10}
    assert backend.hlo_marker == "tpu_custom_call"
    assert backend.capabilities.jax_versions == ">=0.10,<0.13"


def test_import_does_not_import_the_kernels():
    code = (
        "import sys, attn_backend_flash_pallas._plugin as p; p.attn_backends_register(); "
        "print(any('splash_attention' in m or 'pallas.ops' in m for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_manifest_claims_exactly_the_tested_features(flash_pallas_env_off):
    caps = FlashPallasBackend.capabilities
    assert caps.features == {
        "gqa", "causal", "window", "segment_ids", "lengths", "softcap", "return_lse"
    }
    assert not caps.mask and not caps.bias and not caps.bias_grad
    assert caps.differentiable and caps.interpret and not caps.partitionable
    assert caps.dtypes == {"float32", "bfloat16"}
    assert caps.head_dims.reasons(64, "d") == caps.head_dims.reasons(256, "d") == []
    assert caps.head_dims.reasons(32, "d") and caps.head_dims.reasons(512, "d")


def test_cpu_needs_the_switch(flash_pallas_env_off, monkeypatch):
    call, _, _ = _bind()
    assert not interpret_enabled()
    assert BACKEND.capabilities.platforms == {"tpu"}
    reasons = BACKEND.capabilities.unmet(call, "cpu")
    assert len(reasons) == 1 and ENV_VAR in reasons[0] and "interpret_mode()" in reasons[0]
    assert reasons[0].startswith("platform ")
    assert BACKEND.capabilities.unmet(call, "tpu") == []
    with interpret_mode():
        assert interpret_enabled() and BACKEND.capabilities.platforms == {"tpu", "cpu"}
        assert BACKEND.capabilities.unmet(call, "cpu") == []
        with interpret_mode(False):
            assert BACKEND.capabilities.platforms == {"tpu"}
    monkeypatch.setenv(ENV_VAR, "1")
    assert FlashPallasBackend.capabilities.platforms == {"tpu", "cpu"}
    with interpret_mode(False):
        assert not interpret_enabled()
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=ENV_VAR):
        interpret_enabled()


def test_registry_on_cpu_rejects_without_switch_and_names_it(flash_pallas_env_off):
    registry = attn_backends.Registry(only=["flash_pallas"])
    attention = registry.get(device="cpu", backend="flash_pallas")
    q = jnp.zeros((1, 8, 2, 64), jnp.float32)
    with pytest.raises(attn_backends.UnsupportedError, match=ENV_VAR):
        attention(q, q, q)
    with interpret_mode():
        explanation = registry.get(device="cpu").explain(q, q, q, causal=True)
    assert explanation.chosen == "flash_pallas"


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(mask=np.ones((1, 1, 8, 8), bool)), "feature 'mask'"),
        (dict(bias=np.zeros((1, 2, 8, 8), np.float32)), "feature 'bias'"),
        (dict(dtype="float16"), "dtype float16"),
        (dict(d=32), "head_dim=32"),
        (dict(d=320), "head_dim=320"),
    ],
)
def test_core_refuses_what_the_manifest_excludes_before_attend(monkeypatch, kw, word):
    """The manifest alone excludes these: the backend keeps no check() nor attend() copy."""
    dtype, d = kw.pop("dtype", "float32"), kw.pop("d", 64)
    q = jnp.zeros((1, 8, 2, d), dtype)
    k = jnp.zeros((1, 8, 1, d), dtype)

    def attend_must_not_run(*args, **kwargs):
        raise AssertionError("attend ran for a call the manifest excludes")

    monkeypatch.setattr(FlashPallasBackend, "attend", attend_must_not_run)
    registry = attn_backends.Registry(only=["flash_pallas"], probe=None)
    with interpret_mode():
        attention = registry.get(device="cpu", backend="flash_pallas")
        assert BACKEND.check(attn_backends.bind(q, k, k, **kw)[0]) == []
        with pytest.raises(attn_backends.UnsupportedError, match=word):
            attention(q, k, k, **kw)


def test_block_sizes_validate_themselves():
    with pytest.raises(ValueError, match="block_q=100"):
        SplashBlockSizes(block_q=100)
    with pytest.raises(ValueError, match="block_kv_compute"):
        SplashBlockSizes(block_kv=256, block_kv_compute=384)
    with pytest.raises(ValueError, match="use_fused_bwd_kernel"):
        SplashBlockSizes(use_fused_bwd_kernel=True)
    with pytest.raises(ValueError, match="block_q_dq"):
        SplashBlockSizes(block_q_dq=None)
    blocks = SplashBlockSizes(block_kv=512)
    assert blocks.block_kv_compute == 512 and blocks.kv_multiple == 512
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks.block_q = 256  # type: ignore[misc]


@pytest.mark.parametrize(
    "kind, row",
    [("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5p", "v5p"),
     ("TPU v5", "v5p"), ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("cpu", "interpret"),
     (None, "v4"), ("TPU v99", "v4")],
)
def test_device_kind_to_table_row(kind, row):
    assert generation(kind) == row


def test_default_for_long_and_short_sequences():
    long_call, _, _ = _bind(tq=8192, tk=8192)
    v6e = SplashBlockSizes.default_for(long_call, "TPU v6 lite")
    assert (v6e.block_q, v6e.block_kv, v6e.block_kv_compute) == (1024, 1024, 512)
    v4 = SplashBlockSizes.default_for(long_call, "TPU v4")
    assert (v4.block_q, v4.block_kv) == (512, 512)
    # Short sequences shrink the blocks so padding stays small; still multiples of 128.
    short_call, _, _ = _bind(tq=200, tk=600)
    blocks = SplashBlockSizes.default_for(short_call, "TPU v5e")
    assert blocks.padded(short_call) == (256, 640)
    assert SplashBlockSizes.default_for(long_call, "cpu").block_q == 128


def test_padding_keys_get_an_id_no_query_has():
    smallest = np.iinfo(np.int32).min
    q_ids = np.array([[smallest, 0, 5]], np.int32)
    call, operands, _ = _bind(tq=3, tk=3, segment_ids=(q_ids, q_ids), kv_lengths=np.array([2]))
    qi, ki = map(np.asarray, _masks.segment_ids(call, operands, 128, 128))
    assert qi.shape == ki.shape == (1, 128)
    assert list(ki[0, :2]) == [smallest, 0]
    assert not np.isin(ki[0, 2:], q_ids).any()
