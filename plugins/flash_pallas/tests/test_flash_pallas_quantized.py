"""flash_pallas declines quantized paged caches, and why (docs/DESIGN.md,
"Quantized caches"): JAX's TPU ``paged_attention`` takes an int8
``QuantizedTensor`` but broadcasts its scales ``[Hkv, pages, page_size, 1]`` to
``[Hkv, pages, page_size, D]`` float32 outside the kernel, so a step would read
four bytes of scale per element beside each one-byte value. This file is the
minimal reproduction: the day JAX's kernel reads the scales in place, the
second test fails and the manifest can claim int8."""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest


def test_a_quantized_cache_is_refused_with_the_manifests_reason() -> None:
    registry = ab.Registry(probe=None, only=["flash_pallas"])
    with pytest.raises(ab.UnsupportedError, match="cache_dtype int8: reads no such quantized "
                                                  r"cache \(reads none\)"):
        registry.get_paged(device="tpu", backend="flash_pallas", num_q_heads=8, num_kv_heads=2,
                           head_dim=128, page_size=16, dtype="bfloat16", max_q_len=1,
                           cache_dtype="int8")


def test_jax_paged_attention_broadcasts_int8_scales_outside_its_kernel() -> None:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        QuantizedTensor,
    )

    heads, pages, page_size, dim = 2, 64, 16, 128

    def step(q, k, k_scales, v, v_scales, lengths, table):  # type: ignore[no-untyped-def]
        return paged_attention(q, QuantizedTensor(k, k_scales), QuantizedTensor(v, v_scales),
                               lengths, table, pages_per_compute_block=4)

    values = jax.ShapeDtypeStruct((heads, pages, page_size, dim), jnp.int8)
    scales = jax.ShapeDtypeStruct((heads, pages, page_size, 1), jnp.float32)
    text = jax.export.export(jax.jit(step), platforms=["tpu"])(
        jax.ShapeDtypeStruct((8, 8, dim), jnp.float32), values, scales, values, scales,
        jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((8, 8), jnp.int32),
    ).mlir_module()
    widened = f"(tensor<{heads}x{pages}x{page_size}x1xf32>) -> " \
              f"tensor<{heads}x{pages}x{page_size}x{dim}xf32>"
    assert text.count(widened) == 2, "JAX's kernel no longer broadcasts the scales: revisit"
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
