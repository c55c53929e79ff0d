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

import os
import subprocess
import sys
from pathlib import Path

import attn_backends as ab
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.authoring import QUANTIZED_KV_DTYPES
from attn_backends.oracle import paged_case
from attn_backends.tolerances import compare, tolerance

# (q_len, kv_len) per sequence: decode steps of 1 and 2 rows over 1,100 keys
# (three splits), an odd block (33), a single key; beside them a chunk of 5
# (a GEMM tile where 5 x group > 8 rows, else a decode item) and one of 65
# whose last tile holds 1 or 2 positions (4, 6 or 1 rows: a dot tile by
# bfloat16 products over blocks of 128 keys, the weights' pairs past key 32).
SEQS = [(1, 1100), (2, 700), (1, 33), (1, 1), (5, 90), (65, 300)]
SHAPES = [pytest.param(8, 2, 128, {}, id="gqa4-d128"),
          pytest.param(6, 2, 80, {"softcap": 20.0}, id="gqa3-d80-softcap"),
          pytest.param(2, 2, 72, {"window": (40, None)}, id="mha-d72-window")]


@pytest.mark.parametrize(("hq", "hkv", "d", "call"), SHAPES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES)
def test_bfloat16_decode_over_a_quantized_cache_matches_the_oracle(
        kv_dtype: str, hq: int, hkv: int, d: int, call: dict) -> None:
    case = paged_case(SEQS, page_size=16, hq=hq, hkv=hkv, d=d, seed=3,
                      kv_dtype=kv_dtype)
    case.q = np.asarray(jnp.asarray(case.q, jnp.bfloat16).astype(jnp.float32))
    paged = ab.Registry(probe=None).get_paged(
        device="cpu", backend="native_cpu", num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=16, dtype="bfloat16", kv_dtype=kv_dtype, **call)
    cache = paged.from_canonical(*(jnp.asarray(x) for x in case.canonical()))
    out = paged(jnp.asarray(case.q, jnp.bfloat16), cache, case.batch())
    got = np.asarray(out.astype(jnp.float32), np.float64)
    rows = int(case.cu_q_lens[case.num_seqs])
    want = case.expected(**call)[:rows]
    wrong = compare("out", got[:rows], want, tolerance("bfloat16", "out", platform="cpu"))
    assert wrong is None, f"{kv_dtype} hq={hq} hkv={hkv} d={d} {call}: {wrong}"


# The features the decode tiles by bfloat16 products need (dispatch.cc).
BF16_DECODE = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi"}
_STEP = """
import sys
import attn_backends as ab, jax.numpy as jnp, numpy as np
from attn_backends.oracle import paged_case
case = paged_case([(1, 300), (2, 70)], page_size=16, hq=8, hkv=2, d=128, seed=5,
                  kv_dtype="int8")
paged = ab.Registry(probe=None).get_paged(
    device="cpu", backend="native_cpu", num_q_heads=8, num_kv_heads=2, head_dim=128,
    page_size=16, dtype="bfloat16", kv_dtype="int8")
cache = paged.from_canonical(*(jnp.asarray(x) for x in case.canonical()))
out = paged(jnp.asarray(case.q, jnp.bfloat16), cache, case.batch())
sys.stdout.write(np.asarray(out.astype(jnp.float32)).tobytes().hex())
"""


def _step_under(cap: str) -> str:
    env = {**os.environ, "ATTN_NATIVE_CPU_ISA": cap}
    return subprocess.run([sys.executable, "-c", _STEP], env=env, check=True,
                          capture_output=True, text=True).stdout


def test_the_tiles_by_bfloat16_products_run_where_the_cpu_has_them() -> None:
    """A decode step over an int8 cache rounds its weights to bfloat16 in the
    tiles by bfloat16 products, not in x86-64-v3's: uncapped (avx512-bf16) and
    capped at x86-64-v3 its bits differ where the CPU has the features, and are
    the same where it does not (both run x86-64-v3's tiles)."""
    flags = next((set(line.split(":", 1)[1].split())
                  for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), set())
    differ = _step_under("avx512-bf16") != _step_under("x86-64-v3")
    assert differ == (BF16_DECODE <= flags), f"bits differ: {differ}; CPU flags: {sorted(flags)}"
