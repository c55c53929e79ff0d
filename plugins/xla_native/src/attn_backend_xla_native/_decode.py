"""Decode path: split-KV ("flash-decoding") attention of a few query rows
against a long KV cache, with a recomputing custom VJP.

Such a call is bound by reading K and V once, so every product is written
as an elementwise product reduced over one axis, which XLA fuses into one
pass over the cache in its own layout: no transposed copy of K or V, no
matmul with four rows. The GQA group and the query positions are the
innermost axes of the logits, so each kv head is read once for all of its
query heads (see :mod:`._decode_layout`).

The cache is cut into chunks, all processed by the same batched ops (no
loop); each chunk keeps its own max, sum and output, merged by their lse.
Skipping: XLA cannot skip part of one batched op at run time, but it runs
only the taken branch of a conditional, so the call reads only a static
prefix of the cache, picked at run time (``lax.switch``) as the shortest
of a few halving lengths that holds every key below the largest
``kv_lengths``. Chunks inside that prefix but past a shorter row's length
are still read, and masked.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from attn_backends import AttentionCall, Operands
from jax import lax

from ._decode_layout import (
    DECODE_CHUNK,
    DecodePlan,
    chunked,
    pairwise_in,
    q_rows,
    q_unrows,
    visible,
    widen,
)

Array = Any


def decode_attention(
    call: AttentionCall,
    q: Array,
    k: Array,
    v: Array,
    operands: Operands,
    chunk: int = DECODE_CHUNK,
) -> tuple[Array, Array]:
    """Attention for a validated decode ``call``: out ``[B, Tq, Hq, Dv]``
    (q's dtype) and lse ``[B, Hq, Tq]`` float32, differentiable in q, k, v
    and bias. ``chunk``: keys per chunk (cut to Tk)."""
    plan = DecodePlan.of(call, chunk)
    mask = None if operands.mask is None else pairwise_in(plan, operands.mask)
    bias = None if operands.bias is None else pairwise_in(plan, operands.bias)
    return _attention(plan, q, k, v, bias, operands._replace(mask=mask, bias=None))


# The products, written as XLA's cpu fusions ran them fastest in one-off
# timings (BENCHMARKS.md, "Decode"): with several kv heads, an elementwise
# product reduced over one axis, with the group and query axes merged into
# one (G * Tq) axis and no unit axes (the unmerged form with a unit axis ran
# 7x slower); with one kv head (MQA) the G * Tq rows are many and the cache
# is one contiguous [T, E] matrix per batch row, so a matmul reads it best.
_BATCH = ((0,), (0,))


def _dot(a: Array, b: Array, contract: tuple[int, int], batch: Any = _BATCH) -> Array:
    """A matmul in the cache's dtype (float32 weights cast to it, as the
    blockwise kernel does), accumulated in float32."""
    dims = ((contract[:1], contract[1:]), batch)
    a = a.astype(b.dtype)
    wide = jnp.promote_types(b.dtype, jnp.float32)  # float64 stays float64
    return lax.dot_general(a, b, dims, preferred_element_type=wide)


def _rows_dot(x: Array, rows: Array) -> Array:
    """``[B, n, C, Hkv, E] . [B, Hkv, G, Tq, E] -> [B, n, C, Hkv, G, Tq]``,
    over E, float32; both in the call's dtype."""
    b, n, c, h, e = x.shape
    g, t = rows.shape[2:4]
    r = g * t
    if h == 1:
        s = _dot(x.reshape(b, n * c, e), rows.reshape(b, r, e), (2, 2))
    else:
        x, rows = x.reshape(b, n * c, h, 1, e), rows.reshape(b, 1, h, r, e)
        s = jnp.sum(widen(x) * widen(rows), axis=-1)
    return s.reshape(b, n, c, h, g, t)


def _keys_dot(w: Array, x: Array, per_chunk: bool) -> Array:
    """``[B, n, C, Hkv, G, Tq] . [B, n, C, Hkv, E]`` summed over the keys of
    each chunk (``[B, n, Hkv, G, Tq, E]``) or over all (``[B, Hkv, G, Tq, E]``);
    ``w`` float32, ``x`` in the call's dtype."""
    b, n, c, h, g, t = w.shape
    e = x.shape[-1]
    out_shape = (b, n, h, g, t, e) if per_chunk else (b, h, g, t, e)
    if not per_chunk or n == 1:
        n, c = 1, n * c
    if h == 1 and n == 1:
        o = _dot(w.reshape(b, c, g * t), x.reshape(b, c, e), (1, 1))
    elif h == 1:
        o = _dot(w.reshape(b, n, c, g * t), x.reshape(b, n, c, e), (2, 2), ((0, 1), (0, 1)))
    elif n == 1:
        o = jnp.sum(w.reshape(b, c, h, g * t, 1) * widen(x.reshape(b, c, h, 1, e)), axis=1)
    else:
        x = widen(x.reshape(b, n, c, h, 1, e))
        o = jnp.sum(w.reshape(b, n, c, h, g * t, 1) * x, axis=2)
    return o.reshape(out_shape)


def _rows_sum(w: Array, rows: Array) -> Array:
    """``[B, n, C, Hkv, G, Tq] . [B, Hkv, G, Tq, E] -> [B, n * C, Hkv, E]``,
    summed over the rows of each kv head; ``w`` float32, ``rows`` in the
    call's dtype."""
    b, n, c, h, g, t = w.shape
    e = rows.shape[-1]
    if h == 1:
        o = _dot(w.reshape(b, n * c, g * t), rows.reshape(b, g * t, e), (2, 1))
    else:
        rows = widen(rows.reshape(b, 1, h, g * t, e))
        o = jnp.sum(w.reshape(b, n * c, h, g * t, 1) * rows, axis=3)
    return o.reshape(b, n * c, h, e)


def _logits(plan: DecodePlan, q_r: Array, k_c: Array, bias_c: Array | None) -> tuple:
    """Logits ``[B, n, C, Hkv, G, Tq]`` float32 from q ``[B, Hkv, G, Tq, D]``
    and a chunked cache ``[B, n, C, Hkv, D]``; also the softcap's tanh (for
    its derivative), or None."""
    s = _rows_dot(k_c, q_r) * plan.acc(plan.scale)
    capped = None
    if plan.softcap is not None:
        capped = jnp.tanh(s * plan.acc(1.0 / plan.softcap))
        s = capped * plan.acc(plan.softcap)
    if bias_c is not None:
        s = s + bias_c.astype(plan.acc)
    return s, capped


def _pieces(start: int, n: int, chunk: int, arrays: tuple) -> tuple:
    return tuple(None if a is None else chunked(a, start, n, chunk) for a in arrays)


def _chunk_stats(
    plan: DecodePlan, piece: tuple[int, int, int], q_r: Array, k: Array, v: Array,
    bias: Array | None, ops: Operands,
) -> tuple[Array, Array, Array]:
    """Per-chunk max and sum ``[B, n, Hkv, G, Tq]`` and unnormalised output
    ``[B, n, Hkv, G, Tq, Dv]`` of one piece of the cache."""
    k_c, v_c, bias_c = _pieces(*piece, (k, v, bias))
    s, _ = _logits(plan, q_r, k_c, bias_c)
    vis = visible(plan, ops, *piece)
    if vis is not None:
        # Select, never multiply: garbage at hidden keys must not leak.
        s = jnp.where(vis, s, -jnp.inf)
    m = s.max(axis=2)
    # A chunk nothing sees keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m_safe[:, :, None])
    o = _keys_dot(p, v_c, per_chunk=True)
    return m, p.sum(axis=2), o


def _forward_prefix(
    plan: DecodePlan, length: int, q_r: Array, k: Array, v: Array, bias: Array | None,
    ops: Operands,
) -> tuple[Array, Array]:
    """Out ``[B, Hkv, G, Tq, Dv]`` and lse ``[B, Hkv, G, Tq]`` (float32) of
    keys ``[0, length)``: every chunk's statistics, merged by lse."""
    stats = [_chunk_stats(plan, piece, q_r, k, v, bias, ops) for piece in plan.segments(length)]
    m, total, o = (jnp.concatenate(x, axis=1) for x in zip(*stats, strict=True))
    top = m.max(axis=1)
    top_safe = jnp.where(jnp.isneginf(top), 0.0, top)
    weight = jnp.exp(m - top_safe[:, None])
    total = (weight * total).sum(axis=1)
    acc = (weight[..., None] * o).sum(axis=1)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
    return out, jnp.where(seen, top + jnp.log(total), -jnp.inf)


def _pad_keys(x: Array, size: int) -> Array:
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, size - x.shape[1])
    return jnp.pad(x, widths)


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """Sum the broadcast axes of ``x`` down to ``shape`` (same rank)."""
    axes = tuple(
        i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1
    )
    return x.sum(axis=axes, keepdims=True) if axes else x


def _backward_prefix(
    plan: DecodePlan, length: int, q_r: Array, k: Array, v: Array, bias: Array | None,
    ops: Operands, lse: Array, d_out: Array, delta: Array,
) -> tuple[Array, Array, Array, Array | None]:
    """dq ``[B, Hkv, G, Tq, D]`` (without the scale), dk, dv and dbias (keys
    past ``length`` zero), all float32, recomputing the probabilities of
    keys ``[0, length)`` from the saved lse (``+inf`` on rows that see none)."""
    piece = (0, 1, length)
    k_c, v_c, bias_c = _pieces(*piece, (k, v, bias))
    s, capped = _logits(plan, q_r, k_c, bias_c)
    p = jnp.exp(s - lse[:, None, None])
    vis = visible(plan, ops, *piece)
    if vis is not None:
        p = jnp.where(vis, p, 0.0)
    dv = _rows_sum(p, d_out)
    dp = _rows_dot(v_c, d_out)
    ds = p * (dp - delta[:, None, None])
    if vis is not None:
        # Hidden keys may hold garbage V: 0 * inf must not become NaN.
        ds = jnp.where(vis, ds, 0.0)
    dbias = None
    if bias is not None:
        dbias = _pad_keys(_sum_to(ds[:, 0], bias.shape), plan.kv_len)
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    dq = _keys_dot(ds, k_c, per_chunk=False)
    dk = _rows_sum(ds, q_r) * plan.acc(plan.scale)
    return dq, _pad_keys(dk, plan.kv_len), _pad_keys(dv, plan.kv_len), dbias


def _by_prefix(plan: DecodePlan, ops: Operands, fn: Any, *args: Any) -> Any:
    """``fn(length, *args)`` for the shortest prefix length that holds every
    key below the largest kv_lengths; only that branch runs."""
    prefixes = plan.prefixes(ops.kv_lengths is not None)
    if len(prefixes) == 1:
        return fn(prefixes[0], *args)
    need = jnp.max(jnp.clip(ops.kv_lengths.astype(jnp.int32), 0, plan.kv_len))
    index = jnp.sum(need > jnp.asarray(prefixes[:-1], jnp.int32))
    return lax.switch(index, [partial(fn, length) for length in prefixes], *args)


def xla_native_forward_decode(
    plan: DecodePlan, q: Array, k: Array, v: Array, bias: Array | None, ops: Operands
) -> tuple[Array, Array]:
    """Out ``[B, Hkv, G, Tq, Dv]`` and lse ``[B, Hkv, G, Tq]``, float32.

    q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` as
    given; bias and ``ops.mask`` in :func:`pairwise_in` layout."""
    fn = partial(_forward_prefix, plan)
    return _by_prefix(plan, ops, fn, q_rows(plan, q), k, v, bias, ops)


def xla_native_backward_decode(
    plan: DecodePlan, q: Array, k: Array, v: Array, bias: Array | None, ops: Operands,
    lse: Array, d_out: Array, delta: Array,
) -> tuple[Array, Array, Array, Array | None]:
    """dq ``[B, Tq, Hq, D]``, dk, dv ``[B, Tk, Hkv, E]`` and dbias (bias's
    layout), float32. ``lse``, ``d_out`` and ``delta`` in row layout."""
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
    fn = partial(_backward_prefix, plan)
    q_r = q_rows(plan, q)
    dq, dk, dv, dbias = _by_prefix(plan, ops, fn, q_r, k, v, bias, ops, lse, d_out, delta)
    return q_unrows(dq * plan.acc(plan.scale)), dk, dv, dbias


# Jitted under fixed names: the names appear in the lowered program as called
# functions, so one can tell this kernel ran (``Backend.hlo_marker`` is a
# prefix of the forward's name).
_forward_jit = jax.jit(xla_native_forward_decode, static_argnums=0)
_backward_jit = jax.jit(xla_native_backward_decode, static_argnums=0)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(
    plan: DecodePlan, q: Array, k: Array, v: Array, bias: Array | None, ops: Operands
) -> tuple[Array, Array]:
    return _attention_fwd(plan, q, k, v, bias, ops)[0]


def _attention_fwd(
    plan: DecodePlan, q: Array, k: Array, v: Array, bias: Array | None, ops: Operands
) -> tuple[tuple[Array, Array], tuple]:
    out, lse = _forward_jit(plan, q, k, v, bias, ops)
    result = (q_unrows(out).astype(q.dtype), lse.reshape(plan.batch, -1, plan.q_len))
    return result, (q, k, v, bias, ops, out, lse)


def _attention_bwd(plan: DecodePlan, residuals: tuple, cotangents: tuple) -> tuple:
    q, k, v, bias, ops, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = q_rows(plan, d_out.astype(q.dtype))
    d_lse = d_lse.astype(plan.acc).reshape(lse.shape)
    delta = jnp.sum(widen(d_out) * out, axis=-1) - d_lse
    dq, dk, dv, dbias = _backward_jit(plan, q, k, v, bias, ops, lse, d_out, delta)
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None if dbias is None else dbias.astype(bias.dtype),
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)
