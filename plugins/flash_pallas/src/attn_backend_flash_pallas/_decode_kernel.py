"""A Pallas TPU decode kernel that reads a contiguous KV cache where it lies.

Imported lazily (by ``_decode``): importing it imports Pallas' TPU module.

The cache ``[B, Tk, Hkv, D]`` is passed as ``[B, Tk, Hkv*D]``, a reshape that
merges its two minor dims (no data moves in the row-major view the StableHLO
describes; whether a TPU's tiled layout of the cache makes it a bitcast was not
checked without a TPU). Grid ``(B, ceil(Tk / block_k))``; step ``(b, j)``
DMAs keys ``j*block_k ...`` of example b for every kv head at once, block
``(1, block_k, Hkv*D)``, and slices kv head h out of it in the kernel at the
static lanes ``h*D .. (h+1)*D``. Each kv head meets all the query rows of its
group at once: q arrives as ``[B, Hkv, R, D]`` with row ``r = i*G + g`` for
query row i and head ``h*G + g`` of the group (R = Tq*G padded to a multiple
of 8). Online softmax over the key blocks in float32 (running max, sum and
output in VMEM scratch), dots at ``Precision.HIGHEST`` on float32 operands: K
and V are widened, never rounded, so a float32 cache keeps its digits.

Masking is by length: row r sees keys ``[0, lengths[b, i])``. Logits outside
are replaced (``where``, not added to), and V rows at or past the example's
longest length are zeroed before the second dot, so NaN or Inf in unseen keys,
in the padding of a last partial block, or in a row's own hidden tail cannot
reach the output. A row of length 0 gives zeros. The lengths are
scalar-prefetched: the K/V index maps clamp the block index to the example's
last needed block, so blocks past it are not fetched again (the pipeline skips
a DMA whose block index repeats), and their compute is skipped by ``pl.when``.

Mosaic's block rules this relies on: the last two dims of every block are
divisible by (8, 128) or equal to the array's. K/V ``(1, block_k, Hkv*D)``:
``block_k`` is a multiple of 8 or equals Tk, ``Hkv*D`` is the whole dim; q and
out ``(1, Hkv, R, D)``: R and D are whole dims (R also a multiple of 8, D of
128, so the kernel's matmuls are whole (8, 128) tiles). Tk need not be a
multiple of ``block_k``: Pallas pads a last partial block (with unspecified
values on a TPU, NaN in interpret mode), which the masks above hide.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_HIGHEST = jax.lax.Precision.HIGHEST
#: Lanes of the running max / sum scratch (one value broadcast along a vreg row).
_STAT_LANES = 128


@dataclasses.dataclass(frozen=True)
class DecodeKernelPlan:
    """Static shape of one kernel instance (hashable: it keys the cache).

    ``q_len`` Tq, ``group`` G = Hq/Hkv, ``kv_heads`` Hkv, ``head_dim`` D,
    ``block_k`` keys per grid step, ``interpret`` runs the kernel in Pallas'
    interpreter (the cpu branch only; see ``_decode``).
    """

    q_len: int
    group: int
    kv_heads: int
    head_dim: int
    block_k: int
    softcap: float | None
    interpret: bool

    @property
    def rows(self) -> int:
        """R: query rows per kv head, Tq*G padded up to a multiple of 8 (sublanes)."""
        return -(-self.q_len * self.group // 8) * 8


def _kernel(plan: DecodeKernelPlan, lengths_ref, limit_ref, q_ref, k_ref, v_ref, o_ref,  # type: ignore[no-untyped-def]
            m_ref, l_ref, acc_ref):
    b, j = pl.program_id(0), pl.program_id(1)
    rows, d, bk = plan.rows, plan.head_dim, plan.block_k

    @pl.when(j == 0)
    def _init():  # type: ignore[no-untyped-def]
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    limit = limit_ref[b]

    @pl.when(j * bk < limit)
    def _step():  # type: ignore[no-untyped-def]
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
        col = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 1) + j * bk
        # Row r = i*G + g has query row i's length; padding rows keep 0.
        length = jnp.zeros((rows, bk), jnp.int32)
        for i in range(plan.q_len):
            mine = (row >= i * plan.group) & (row < (i + 1) * plan.group)
            length = jnp.where(mine, lengths_ref[b * plan.q_len + i], length)
        seen = col < length
        key = jax.lax.broadcasted_iota(jnp.int32, (bk, d), 0) + j * bk
        key_used = key < limit
        for h in range(plan.kv_heads):
            q = q_ref[0, h]  # [R, D] float32, pre-scaled
            k = k_ref[0, :, h * d:(h + 1) * d].astype(jnp.float32)  # [bk, D]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                    preferred_element_type=jnp.float32)  # [R, bk]
            if plan.softcap is not None:
                s = plan.softcap * jnp.tanh(s / plan.softcap)
            s = jnp.where(seen, s, -jnp.inf)
            v = jnp.where(key_used, v_ref[0, :, h * d:(h + 1) * d].astype(jnp.float32), 0.0)
            online_step(h, s, v, lambda p: p, m_ref, l_ref, acc_ref)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():  # type: ignore[no-untyped-def]
        finish(plan.kv_heads, l_ref, acc_ref, o_ref)


def online_step(h: int, s: Any, v: Any, weigh: Callable[[Any], Any], m_ref: Any, l_ref: Any,
                acc_ref: Any) -> None:
    """One block of kv head h's online softmax (also the quantized paged kernel's):
    scores ``s [R, bk]`` (-inf where unseen), values ``v [bk, D]`` float32 (zeroed
    where unused), ``weigh(p)`` the weights V is summed with (``p``, or ``p``
    times V's scales); the running max, sum and output in ``m_ref``, ``l_ref``,
    ``acc_ref`` (``[Hkv, R, lanes]``, ``[Hkv, R, lanes]``, ``[Hkv, R, D]``)."""
    rows = s.shape[0]
    m_prev = m_ref[h][:, :1]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # A row that has seen nothing yet keeps max -inf; 0 in its place
    # keeps exp() at exp(-inf) = 0 instead of exp(nan).
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    pv = jax.lax.dot_general(weigh(p), v, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)  # [R, D]
    l_next = alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[h] = alpha * acc_ref[h] + pv
    m_ref[h] = jnp.broadcast_to(m_next, (rows, _STAT_LANES))
    l_ref[h] = jnp.broadcast_to(l_next, (rows, _STAT_LANES))


def finish(kv_heads: int, l_ref: Any, acc_ref: Any, o_ref: Any) -> None:
    """``o_ref[0, h]`` = the running output over the running sum (0 where a row
    saw no key), for every kv head."""
    for h in range(kv_heads):
        total = l_ref[h][:, :1]
        o_ref[0, h] = jnp.where(total > 0, acc_ref[h] / jnp.where(total > 0, total, 1.0), 0.0)


@functools.lru_cache(maxsize=64)
def decode_fn(plan: DecodeKernelPlan) -> Callable[..., Any]:
    """``f(q, k, v, lengths, limit) -> out``: one ``pallas_call`` over the batch.

    q ``[B, Hkv, R, D]`` float32 (scaled; row ``i*G + g`` is query row i, head
    ``h*G + g``), k and v ``[B, Tk, Hkv*D]`` (any float dtype), lengths int32
    ``[B*Tq]`` (row i of example b at ``b*Tq + i``), limit int32 ``[B]`` (the
    example's longest length) -> out ``[B, Hkv, R, D]`` float32.
    """
    rows, d, hkv, bk = plan.rows, plan.head_dim, plan.kv_heads, plan.block_k

    def kv_index(b, j, lengths, limit):  # type: ignore[no-untyped-def]
        # Past the example's last needed block the index repeats: no new DMA.
        last = jnp.maximum(pl.cdiv(limit[b], bk) - 1, 0)
        return b, jnp.minimum(j, last), 0

    def q_index(b, j, lengths, limit):  # type: ignore[no-untyped-def]
        return b, 0, 0, 0

    def call(q: Any, k: Any, v: Any, lengths: Any, limit: Any) -> Any:
        batch, tk = k.shape[0], k.shape[1]
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pl.cdiv(tk, bk)),
            in_specs=[
                pl.BlockSpec((1, hkv, rows, d), q_index),
                pl.BlockSpec((1, bk, hkv * d), kv_index),
                pl.BlockSpec((1, bk, hkv * d), kv_index),
            ],
            out_specs=pl.BlockSpec((1, hkv, rows, d), q_index),
            scratch_shapes=[
                pltpu.VMEM((hkv, rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((hkv, rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((hkv, rows, d), jnp.float32),
            ],
        )
        return pl.pallas_call(
            functools.partial(_kernel, plan),
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct((batch, hkv, rows, d), jnp.float32),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary")),
            interpret=plan.interpret,
            name="contiguous_decode_attention",
        )(lengths, limit, q, k, v)

    return call
