"""Selection for a TPU from a machine without one: manifest only, for export.

flash_pallas > xla_native > reference on tpu; a feature the Pallas kernels
cannot serve goes to xla_native with one FallbackWarning; eager use is refused.
"""

from __future__ import annotations

import warnings

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from _support import qkv


@pytest.fixture
def tpu_attention(monkeypatch):
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    registry = ab.Registry(only=["flash_pallas", "xla_native", "reference"])
    return registry.get(device="tpu")


def _export(attention, *args, **kwargs):
    fn = jax.jit(lambda q, k, v: attention(q, k, v, **kwargs))
    return jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()


def test_priority_on_tpu_is_pallas_then_xla_then_reference(tpu_attention):
    q, k, v = qkv(tq=256, tk=256, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    exp = tpu_attention.explain(q, k, v, causal=True)
    assert [v.backend for v in exp.verdicts] == ["flash_pallas", "xla_native", "reference"]
    assert exp.chosen == "flash_pallas" and exp.present is False
    assert all(v.probed is None for v in exp.verdicts)  # no TPU here: unprobed


def test_kernel_call_exports_with_the_pallas_custom_call_and_no_warning(tpu_attention):
    q, k, v = qkv(tq=256, tk=256, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = _export(tpu_attention, q, k, v, causal=True)
    assert "tpu_custom_call" in module and "attn/flash_pallas" in module


def test_bias_goes_to_xla_native_with_one_warning_naming_flash_pallas(tpu_attention):
    q, k, v = qkv(tq=256, tk=256, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    bias = jnp.zeros((1, 8, 256, 256), jnp.bfloat16)
    exp = tpu_attention.explain(q, k, v, causal=True, bias=bias)
    verdicts = {v.backend: v for v in exp.verdicts}
    assert exp.chosen == "xla_native"
    assert verdicts["flash_pallas"].reasons == ("feature 'bias' not supported",)
    with pytest.warns(ab.FallbackWarning) as record:
        fn = jax.jit(lambda q, k, v, b: tpu_attention(q, k, v, causal=True, bias=b))
        module = jax.export.export(fn, platforms=["tpu"])(q, k, v, bias).mlir_module()
        jax.export.export(fn, platforms=["tpu"])(q, k, v, bias)  # same signature: no repeat
    assert len(record) == 1
    assert (
        "served by 'xla_native', passing over flash_pallas: feature 'bias' not supported"
        in str(record[0].message)
    )
    assert "tpu_custom_call" not in module and "attn/xla_native" in module


def test_eager_call_for_an_absent_tpu_names_the_visible_platforms(tpu_attention):
    q, k, v = qkv(tq=128, tk=128, hq=2, hkv=2, d=64)
    with pytest.raises(ab.PlatformUnavailableError, match=r"JAX sees no tpu here \(visible: cpu\)"):
        tpu_attention(q, k, v)
