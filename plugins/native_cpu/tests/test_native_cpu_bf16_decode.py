"""native_cpu's decode tiles of bfloat16 queries over a quantized cache
(csrc/bf16_decode.h: bytes widened to bfloat16 by tables, vdpbf16ps products,
on CPUs with AVX512_BF16 and AVX512_VBMI; the x86-64-v3 kernels elsewhere)
against the float64 oracle on the dequantized cache, at the bfloat16 tolerance,
with garbage (every byte value, NaN and Inf scales) in the unused slots.

The shapes reach the structure: keys over several 32-key blocks and 512-key
splits, blocks of odd length (a last key paired with zeros), one position or
two per sequence (4 or 8 rows per kv head: one or two groups of 4 rows), groups
of 3 and of 1 query heads per kv head (tiles of 3 x 5 and 1 x 16 scores), head
dims past a multiple of 64 (K's bytes) and of 32 (V's), softcap and a window.
"""

from __future__ import annotations

import attn_backends as ab
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.oracle import paged_case
from attn_backends.tolerances import compare, tolerance

# (q_len, kv_len) per sequence: decode steps of 1 and 2 rows over 1,100 keys
# (three splits), an odd block (33), a single key; a chunk of 5 (tiles) beside them.
SEQS = [(1, 1100), (2, 700), (1, 33), (1, 1), (5, 90)]
SHAPES = [pytest.param(8, 2, 128, {}, id="gqa4-d128"),
          pytest.param(6, 2, 80, {"softcap": 20.0}, id="gqa3-d80-softcap"),
          pytest.param(2, 2, 72, {"window": (40, None)}, id="mha-d72-window")]


@pytest.mark.parametrize(("hq", "hkv", "d", "call"), SHAPES)
@pytest.mark.parametrize("cache_dtype", ab.QUANTIZED_CACHE_DTYPES)
def test_bfloat16_decode_over_a_quantized_cache_matches_the_oracle(
        cache_dtype: str, hq: int, hkv: int, d: int, call: dict) -> None:
    case = paged_case(SEQS, page_size=16, hq=hq, hkv=hkv, d=d, seed=3,
                      cache_dtype=cache_dtype)
    case.q = np.asarray(jnp.asarray(case.q, jnp.bfloat16).astype(jnp.float32))
    paged = ab.Registry(probe=None).get_paged(
        device="cpu", backend="native_cpu", num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=16, dtype="bfloat16", cache_dtype=cache_dtype, **call)
    cache = paged.from_canonical(*(jnp.asarray(x) for x in case.canonical()))
    out = paged(jnp.asarray(case.q, jnp.bfloat16), cache, case.batch())
    got = np.asarray(out.astype(jnp.float32), np.float64)
    rows = int(case.cu_q_lens[case.num_seqs])
    want = case.expected(**call)[:rows]
    wrong = compare("out", got[:rows], want, tolerance("bfloat16", "out", platform="cpu"))
    assert wrong is None, f"{cache_dtype} hq={hq} hkv={hkv} d={d} {call}: {wrong}"
