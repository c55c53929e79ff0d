"""Forward pass: online softmax over the visible key blocks of each query block."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from ._plan import Masks, Plan, visibility
from ._ranges import has_positional_mask, kv_blocks_for, visit
from ._tile import dot_nn, logits

Array = Any


def xla_native_forward(
    plan: Plan,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    masks: Masks,
) -> tuple[Array, Array]:
    """Blocked attention forward.

    q ``[n_q, B, Hkv, rows, D]``, k transposed ``[n_kv, B, Hkv, D, block_kv]``, v
    ``[n_kv, B, Hkv, block_kv, Dv]``, bias padded ``[B|1, Hkv|1, G|1, Tq_pad,
    Tk_pad]``. Returns out ``[n_q, B, Hkv, rows, Dv]`` (q's dtype) and lse
    ``[n_q, B, Hkv, rows]`` float32, ``-inf`` for rows that see no key.
    """
    lead = q.shape[1:4]

    def one_query_block(args: tuple[Array, Array]) -> tuple[Array, Array]:
        qi, q_tile = args

        def body(kj: Array, carry: tuple, positional: bool) -> tuple:
            m, row_sum, acc = carry
            k_tile = lax.dynamic_index_in_dim(k, kj, keepdims=False)
            v_tile = lax.dynamic_index_in_dim(v, kj, keepdims=False)
            s, _ = logits(plan, q_tile, k_tile, bias, qi, kj)
            vis = visibility(plan, masks, qi, kj, positional)
            if vis is not None:
                # Select, never multiply: garbage at hidden keys must not leak.
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            # A row that has seen no key yet keeps m = -inf; shift by 0 so
            # exp() gives 0 instead of NaN.
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            row_sum = alpha * row_sum + p.sum(axis=-1)
            acc = acc * alpha[..., None] + dot_nn(p.astype(v.dtype), v_tile)
            return m_new, row_sum, acc

        carry = (
            jnp.full(lead, -jnp.inf, jnp.float32),
            jnp.zeros(lead, jnp.float32),
            jnp.zeros((*lead, v.shape[-1]), jnp.float32),
        )
        bounds = kv_blocks_for(plan, masks, qi)
        m, row_sum, acc = visit(bounds, body, carry, has_positional_mask(plan, masks))
        seen = row_sum > 0
        row_sum = jnp.where(seen, row_sum, 1.0)
        out = jnp.where(seen[..., None], acc / row_sum[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(row_sum), -jnp.inf)
        return out.astype(q.dtype), lse

    return lax.map(one_query_block, (jnp.arange(plan.n_q, dtype=jnp.int32), q))
