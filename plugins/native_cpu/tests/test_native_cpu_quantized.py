"""native_cpu reads every byte of a quantized cache as the format says: one key
whose V row holds all 256 byte values (two rows of 128), K's row zeros and both
scales 1, so each query head's output is exactly that V row dequantized; through
a decode tile (2 query heads: values read in place, widened in registers) and a
prefill tile (16 query heads per kv head: the block dequantized into scratch),
against ml_dtypes' reading of the same bytes (NaN where it says NaN, and the
float8 formats' subnormals, infinities and signed zeros). Queries in float32
and in bfloat16: a bfloat16 decode tile widens the bytes to bfloat16 by tables
where the CPU has AVX512_BF16 and AVX512_VBMI (csrc/bf16_decode.h)."""

from __future__ import annotations

import attn_backends as ab
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from attn_backends.authoring import QUANTIZED_KV_DTYPES


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [2, 16], ids=["decode-tile", "prefill-tile"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES)
def test_every_byte_reads_as_its_format_says(kv_dtype: str, heads: int, dtype: str) -> None:
    paged = ab.Registry(probe=None).get_paged(
        device="cpu", backend="native_cpu", num_q_heads=heads, num_kv_heads=1, head_dim=128,
        page_size=1, dtype=dtype, kv_dtype=kv_dtype)
    stored = np.dtype(getattr(ml_dtypes, kv_dtype, kv_dtype))
    batch = ab.PagedBatch(jnp.asarray([0, 1], jnp.int32), jnp.asarray([1], jnp.int32),
                          jnp.zeros((1, 1), jnp.int32), jnp.int32(1))
    q = jnp.ones((1, heads, 128), dtype)
    for half in (0, 1):
        row = np.arange(128 * half, 128 * (half + 1), dtype=np.uint8).view(stored)
        values = jnp.asarray(row.reshape(1, 1, 1, 128))
        ones = jnp.ones((1, 1, 1), jnp.float32)
        cache = paged.from_canonical(jnp.zeros_like(values), values, ones, ones)
        # Every int8 and float8 value is a bfloat16 value: exact in both dtypes.
        got = np.asarray(paged(q, cache, batch).astype(jnp.float32))
        want = row.astype(np.float32)
        for h in range(heads):
            np.testing.assert_array_equal(got[0, h], want, err_msg=f"head {h}, bytes "
                                          f"{128 * half}..{128 * half + 127}")
