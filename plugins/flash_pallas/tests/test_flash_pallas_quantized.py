"""flash_pallas over quantized paged caches (docs/DESIGN.md, "Quantized caches").

Decode steps (``max_q_len=1``) go to the plugin's own kernel
(``_paged_quantized.py``), which reads int8 or float8 values and their
per-position scales where they lie: in Pallas' interpreter here it equals the
float64 oracle on the dequantized cache with garbage in every unused value and
scale slot, and its TPU export holds the kernel with nothing cache-sized
computed outside it. Other quantized calls are declined with the reason.

Why not JAX's ``paged_attention``, which takes an int8 ``QuantizedTensor``: it
broadcasts the scales ``[Hkv, pages, page_size, 1]`` to ``[Hkv, pages,
page_size, D]`` float32 outside its kernel, four bytes per element beside each
one-byte value. The last test is that finding's minimal reproduction: the day
it fails, JAX's kernel reads the scales in place.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import POOL, TPU, cache_sized_ops
from attn_backends.oracle import paged_case
from attn_backends.probe.tolerances import compare, tolerance

CALL = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, max_q_len=1)


@pytest.mark.parametrize("kv_dtype, dtype, window", [
    ("int8", "bfloat16", None), ("float8_e4m3fn", "float32", 20), ("float8_e5m2", "float32", None)])
def test_decode_steps_read_the_quantized_pages_in_interpret_mode(monkeypatch, kv_dtype,
                                                                 dtype, window):
    monkeypatch.setenv("ATTN_BACKENDS_PALLAS_INTERPRET", "1")
    paged = ab.Registry(probe=None).get_paged(
        device="cpu", backend="flash_pallas", dtype=dtype, kv_dtype=kv_dtype,
        softcap=20.0, window=None if window is None else (window, None), **CALL)
    assert paged.layout == "heads_first"
    # Three decode steps over 1 to 3 pages (the last partial), an uncounted row
    # and padding rows; garbage in every unused value and scale slot.
    seqs = [(1, 40), (1, 16), (1, 3), (1, 9)]
    dirty, clean = (paged_case(seqs, page_size=16, hq=8, hkv=2, d=128, num_seqs=3, pad_rows=2,
                               garbage=g, kv_dtype=kv_dtype) for g in (True, False))
    step = jax.jit(lambda q, b, *a: paged(q, paged.from_canonical(*a), b))
    q = jnp.asarray(clean.q).astype(dtype)
    outs = [np.asarray(step(q, c.batch(), *(jnp.asarray(x) for x in c.canonical())))
            for c in (dirty, clean)]
    assert np.array_equal(outs[0], outs[1])
    clean.q = np.asarray(q.astype(jnp.float32))  # the oracle sees q as the kernel does
    want = clean.expected(scale=paged.call.scale, softcap=20.0,
                          window=None if window is None else (window, None))
    got = outs[1].astype(np.float64)
    assert compare("out", got, want, tolerance(dtype, "out", platform="cpu")) is None

def test_calls_other_than_decode_steps_are_declined_with_the_reason() -> None:
    registry = ab.Registry(probe=None, only=["flash_pallas"])
    with pytest.raises(ab.UnsupportedError, match="max_q_len=None: the quantized decode "
                                                  "kernel takes one query row per sequence"):
        registry.get_paged(device="tpu", backend="flash_pallas", dtype="bfloat16",
                           kv_dtype="int8", **{**CALL, "max_q_len": None})


def test_tpu_export_reads_the_int8_pages_and_scales_in_place(monkeypatch) -> None:
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    paged = ab.registry.get_paged(device="tpu", backend="flash_pallas", dtype="bfloat16",
                                  kv_dtype="int8", **CALL)
    spec = jax.ShapeDtypeStruct
    cache = jax.eval_shape(lambda: paged.init_cache(POOL))
    i32 = jnp.int32
    batch = ab.PagedBatch(spec((9,), i32), spec((8,), i32), spec((8, 6), i32), spec((), i32))
    with jax.sharding.use_abstract_mesh(TPU):
        module = jax.export.export(jax.jit(paged.__call__), platforms=["tpu"])(
            spec((8, 8, 128), jnp.bfloat16), cache, batch).mlir_module()
    assert module.count("stablehlo.custom_call @tpu_custom_call") == 1
    assert "quantized_paged_decode_attention" in module
    # The values pass into the kernel as they lie; nothing of the values' size
    # is computed outside it (no widening, no broadcast of the scales).
    assert cache_sized_ops(module, (2, POOL, 16, 128), "i8") == []
    assert cache_sized_ops(module, (2, POOL, 16, 128), "f32") == []
    assert cache_sized_ops(module, (2, POOL, 16, 128), "bf16") == []


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
