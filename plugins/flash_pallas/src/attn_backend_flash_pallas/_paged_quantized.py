"""Decode steps over a quantized paged cache (int8, float8: values and a float32
scale per position and kv head, docs/DESIGN.md "Quantized caches"): a Pallas TPU
kernel of this plugin's own that reads values and scales as they lie in core's
``heads_first`` layout (values ``[Hkv, num_pages, page_size, D]``, scales
``[Hkv, num_pages, page_size]``).

Why not JAX's ``paged_attention``: it takes int8 values with scales but
broadcasts the scales to the values' shape in float32 before its kernel (four
bytes per element beside the one-byte value; ``tests/test_flash_pallas_quantized.py``),
and its ragged kernel takes one scale per tensor.

The kernel: grid ``(T, P)``, one query row t (every query head, grouped by kv
head: ``[Hkv, G, D]``) against page j of its table row per step. The page index
is read from the scalar-prefetched table (clipped into the pool, and past the
row's last page held at that page, so no new block is fetched); a page outside
the row's keys (past its length, before its window) is skipped by ``pl.when``.
Per kv head: scores ``q . value`` in float32 (the values widened, never the
scale folded into them), times K's scale of each key (a row of ``page_size``
lanes: scales are passed as ``[Hkv, num_pages, 1, page_size]``, a reshape that
adds a unit axis), softcap, the keys the row cannot see replaced by -inf
(``where``); an online softmax; the weights times V's scales, V's rows the row
cannot see zeroed, then ``weights . values``. So NaN or Inf in an unused value or
scale slot never reaches a result, and a NaN scale (a non-finite token, the
contract's rule) reaches only the rows that see its key.

One page per step is a small block for a TPU (``page_size x D`` values); the
kernel's speed on a TPU is unmeasured here (no TPU): what it is certified for is
the contract (Pallas' interpreter on cpu, the suite's quantized family) and
the export (one ``tpu_custom_call`` reading the int8 pages and the scales with
nothing cache-sized computed outside it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import paged_rows

#: Lanes of the running max / sum scratch, as ``_decode_kernel``'s.
_STAT_LANES = 128


def declines(call: PagedCall) -> list[str]:
    """Why this kernel does not serve ``call`` (empty: it does)."""
    reasons = []
    if not call.quantized:
        reasons.append("the quantized decode kernel reads quantized caches only")
    if call.max_q_len != 1:
        reasons.append(f"max_q_len={call.max_q_len}: the quantized decode kernel takes one "
                       "query row per sequence (max_q_len=1)")
    return reasons


def _kernel(ps: int, hkv: int, softcap: float | None, lengths_ref, first_ref, table_ref,  # type: ignore[no-untyped-def]
            q_ref, k_ref, ks_ref, v_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from ._decode_kernel import finish, online_step

    t, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _init():  # type: ignore[no-untyped-def]
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    length, first = lengths_ref[t], first_ref[t]

    @pl.when((j * ps < length) & ((j + 1) * ps > first))
    def _step():  # type: ignore[no-untyped-def]
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, ps), 1) + j * ps
        seen = (lane < length) & (lane >= first)  # [1, ps]: the keys this row sees
        row = jax.lax.broadcasted_iota(jnp.int32, (ps, 1), 0) + j * ps
        used = (row < length) & (row >= first)  # [ps, 1]: the same keys, as V's rows
        for h in range(hkv):
            q = q_ref[0, h]  # [G, D] float32, pre-scaled
            k = k_ref[h, 0].astype(jnp.float32)  # [ps, D]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32)  # [G, ps]
            s = s * ks_ref[h, 0]  # K's scale per key: [1, ps]
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(seen, s, -jnp.inf)
            v = jnp.where(used, v_ref[h, 0].astype(jnp.float32), 0.0)  # [ps, D]
            # The weights times V's scale per key, 0 where unseen (a NaN scale
            # there never meets a zero weight).
            online_step(h, s, v, lambda p, h=h: jnp.where(seen, p * vs_ref[h, 0], 0.0),
                        m_ref, l_ref, acc_ref)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():  # type: ignore[no-untyped-def]
        finish(hkv, l_ref, acc_ref, o_ref)


@functools.lru_cache(maxsize=64)
def _call(rows: int, hkv: int, group: int, dim: int, ps: int, width: int,
          softcap: float | None, interpret: bool) -> Callable[..., Any]:
    """``f(lengths, first, table, q, k, k_scales, v, v_scales) -> out [T, Hkv, G, D]``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def page(t, j, lengths, first, table):  # type: ignore[no-untyped-def]
        # The row's pages from its window's first to its last; outside them the
        # index repeats its nearest, so no block is fetched again.
        lo = first[t] // ps
        hi = jnp.maximum((lengths[t] + ps - 1) // ps - 1, lo)
        return table[t * width + jnp.clip(j, lo, hi)]

    def values(t, j, *refs):  # type: ignore[no-untyped-def]
        return 0, page(t, j, *refs), 0, 0

    def query(t, j, *refs):  # type: ignore[no-untyped-def]
        return t, 0, 0, 0

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(rows, width),
        in_specs=[pl.BlockSpec((1, hkv, group, dim), query),
                  pl.BlockSpec((hkv, 1, ps, dim), values),
                  pl.BlockSpec((hkv, 1, 1, ps), values),
                  pl.BlockSpec((hkv, 1, ps, dim), values),
                  pl.BlockSpec((hkv, 1, 1, ps), values)],
        out_specs=pl.BlockSpec((1, hkv, group, dim), query),
        scratch_shapes=[pltpu.VMEM((hkv, group, _STAT_LANES), jnp.float32),
                        pltpu.VMEM((hkv, group, _STAT_LANES), jnp.float32),
                        pltpu.VMEM((hkv, group, dim), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, ps, hkv, softcap), grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, hkv, group, dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="quantized_paged_decode_attention")


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    interpret: bool) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns see no
    key: zeros. ``interpret``: run the kernel in Pallas' interpreter (cpu)."""
    import jax.numpy as jnp

    rows, width = q.shape[0], batch.page_table.shape[1]
    if rows == 0 or batch.page_table.shape[0] == 0:
        return jnp.zeros_like(q)
    seq, owned, pos = paged_rows(batch, rows)
    lengths = jnp.where(owned, jnp.clip(pos + 1, 0, width * call.page_size), 0)
    first = jnp.zeros_like(lengths) if call.window is None else jnp.maximum(
        lengths - 1 - call.window[0], 0)
    table = jnp.clip(batch.page_table[seq], 0, cache.num_pages - 1)
    k, v, k_scales, v_scales = cache.arrays
    heads, pages, ps = k_scales.shape
    # [Hkv, pages, page_size] -> [Hkv, pages, 1, page_size]: a unit axis, so a
    # page's scales are one row of lanes.
    k_scales, v_scales = (x.reshape(heads, pages, 1, ps) for x in (k_scales, v_scales))
    group, dim = call.group, call.head_dim
    q4 = (q.astype(jnp.float32) * jnp.float32(call.scale)).reshape(rows, heads, group, dim)
    run = _call(rows, heads, group, dim, ps, width, call.softcap, interpret)
    out = run(lengths.astype(jnp.int32), first.astype(jnp.int32),
              table.reshape(-1).astype(jnp.int32), q4, k, k_scales, v, v_scales)
    return out.reshape(rows, call.q_heads, dim).astype(q.dtype)
