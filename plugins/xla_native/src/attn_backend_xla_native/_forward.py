"""Forward pass: online softmax over the visible key blocks of each query block."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from attn_backends.authoring import vary_like
from jax import lax

from ._plan import (
    Masks,
    Plan,
    kv_block,
    put_q_block,
    put_row_block,
    q_block,
    tile_keep,
    visibility,
)
from ._ranges import has_positional_mask, kv_blocks_for, visit
from ._tile import dot_nn, logits

Array = Any


def _step(s: Array, vis: Array | None, carry: tuple, v_tile: Array,
          dropped: Any = None) -> tuple:
    """Online-softmax update of ``(m, row_sum, acc)`` with one tile.

    ``dropped(p)``: the tile's probabilities after dropout (None: none); the
    row sums (so the lse) stay those of the undropped ones."""
    m, row_sum, acc = carry
    if vis is not None:
        # Select, never multiply: garbage at hidden keys must not leak.
        s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 so exp()
    # gives 0 instead of NaN.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    row_sum = alpha * row_sum + p.sum(axis=-1)
    if dropped is not None:
        p = dropped(p)
    acc = acc * alpha[..., None] + dot_nn(p.astype(v_tile.dtype), v_tile)
    return m_new, row_sum, acc


def xla_native_forward(
    plan: Plan,
    q_scale: float,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    masks: Masks,
    seed: Array | None = None,
    scales: tuple[Array, Array] | None = None,
) -> tuple[Array, Array]:
    """Blocked attention forward.

    q ``[B, Tq_pad, Hq, D]`` and v ``[B, Tk_pad, Hkv, Dv]`` in the caller's
    layout (zero-padded to whole blocks), k transposed ``[n_kv, B, Hkv, D,
    block_kv]``, bias padded ``[B|1, Hkv|1, G|1, Tq_pad, Tk_pad]``; each q
    tile is multiplied by ``q_scale`` as it is read. Returns out ``[B,
    Tq_pad, Hq, Dv]`` (q's dtype) and lse ``[B, Hq, Tq_pad]`` float32,
    ``-inf`` for rows that see no key. ``seed`` (``uint32[2]``, with
    ``plan.dropout_rate``) draws each tile's dropout keep bits. ``scales``:
    a quantized K and V's (``call.kv_dtype``), K's ``[n_kv, B, Hkv, 1,
    block_kv]`` as k is laid out and V's ``[B, Tk_pad, Hkv, 1]``: each key
    block is dequantized (value * scale, float32) as it is read, never the
    whole K or V at once.

    q and v tiles are moved into tile layout inside the loop and each
    output tile is written straight back to the caller's layout: no
    transposed copy of q, v or the output is materialised, which keeps the
    program's temporary memory (and the page faults of allocating it on
    every call) small.
    """
    lead = (plan.batch, plan.kv_heads, plan.rows)

    def one_query_block(qi: Array, results: tuple[Array, Array]) -> tuple[Array, Array]:
        q_tile = q_block(plan, q, qi)
        if q_scale != 1.0:
            q_tile = (q_tile * jnp.asarray(q_scale, q.dtype)).astype(q.dtype)
        if scales is not None:  # products with the dequantized float32 tiles
            q_tile = q_tile.astype(plan.acc)

        def body(kj: Array, carry: tuple, positional: bool) -> tuple:
            k_tile = lax.dynamic_index_in_dim(k, kj, keepdims=False)
            v_tile = kv_block(plan, v, kj)
            if scales is not None:
                k_tile = k_tile.astype(plan.acc) * lax.dynamic_index_in_dim(
                    scales[0], kj, keepdims=False)
                v_tile = v_tile.astype(plan.acc) * kv_block(plan, scales[1], kj)
            s, _ = logits(plan, q_tile, k_tile, bias, qi, kj)
            vis = visibility(plan, masks, qi, kj, positional)
            dropped = None
            if plan.dropout_rate:
                keep = tile_keep(plan, seed, qi, kj)
                inv = jnp.float32(1.0 / (1.0 - plan.dropout_rate))

                def dropped(p: Array) -> Array:
                    return jnp.where(keep, p * inv, 0.0)

            return _step(s, vis, carry, v_tile, dropped)

        carry = vary_like((
            jnp.full(lead, -jnp.inf, plan.acc),
            jnp.zeros(lead, plan.acc),
            jnp.zeros((*lead, v.shape[-1]), plan.acc),
        ), q, k, v, bias)
        bounds = kv_blocks_for(plan, masks, qi)
        m, row_sum, acc = visit(bounds, body, carry, has_positional_mask(plan, masks))
        seen = row_sum > 0
        row_sum = jnp.where(seen, row_sum, 1.0)
        out = jnp.where(seen[..., None], acc / row_sum[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(row_sum), -jnp.inf)
        out_all, lse_all = results
        return put_q_block(plan, out_all, out, qi), put_row_block(plan, lse_all, lse, qi)

    # Built from q so that, under explicit sharding, they carry q's sharding
    # of batch and heads, as the tiles written into them do.
    zeros = jnp.zeros_like(q[..., :1])
    results = (
        jnp.broadcast_to(zeros, (*q.shape[:3], v.shape[-1])),
        zeros[..., 0].transpose(0, 2, 1).astype(plan.acc),
    )
    # int32 bounds: block indices stay int32 under x64 too (dynamic_slice
    # needs one index type, and the key block indices are int32).
    return lax.fori_loop(jnp.int32(0), jnp.int32(plan.n_q), one_query_block, results)
