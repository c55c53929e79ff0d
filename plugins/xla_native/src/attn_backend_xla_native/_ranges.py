"""Which blocks a tile loop must visit, so work follows the visible area.

Each function returns ``(lo, full_lo, full_hi, hi)`` int32 scalars: blocks
``[lo, hi)`` may hold a visible key, and inside them ``[full_lo, full_hi)``
are entirely inside causal, window, kv padding and kv_lengths, so their
tiles skip those positional masks. ``lo <= full_lo <= full_hi <= hi``.
Bounds are computed for all rows of a batch together (max/min over lengths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from ._plan import Masks, Plan

Array = Any


def _ceil_div(a: Array, b: int) -> Array:
    return -((-a) // b)


def _finish(lo: Array, hi: Array, full_lo: Array, full_hi: Array) -> tuple[Array, ...]:
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def kv_blocks_for(plan: Plan, masks: Masks, qi: Array) -> tuple[Array, ...]:
    """Key blocks query block ``qi`` must visit (forward pass)."""
    bq, bk, off = plan.block_q, plan.block_kv, plan.offset
    qi = jnp.asarray(qi, jnp.int32)
    first = qi * bq
    last = jnp.minimum(first + bq - 1, plan.q_len - 1)
    lo_key = jnp.int32(0)
    hi_key = jnp.int32(plan.kv_len)
    full_lo = jnp.int32(0)
    full_hi = jnp.int32(plan.kv_len // bk)
    if plan.causal:
        hi_key = jnp.minimum(hi_key, last + off + 1)
        full_hi = jnp.minimum(full_hi, (first + off + 1) // bk)
    if plan.right is not None:
        hi_key = jnp.minimum(hi_key, last + off + plan.right + 1)
        full_hi = jnp.minimum(full_hi, (first + off + plan.right + 1) // bk)
    if plan.left is not None:
        lo_key = jnp.maximum(lo_key, first + off - plan.left)
        full_lo = jnp.maximum(full_lo, _ceil_div(last + off - plan.left, bk))
    if masks.kv_len is not None:
        hi_key = jnp.minimum(hi_key, jnp.max(masks.kv_len))
        full_hi = jnp.minimum(full_hi, jnp.min(masks.kv_len) // bk)
    if masks.q_len is not None:
        hi_key = jnp.where(first < jnp.max(masks.q_len), hi_key, lo_key)
    lo = lo_key // bk
    hi = jnp.where(hi_key > lo_key, _ceil_div(hi_key, bk), lo)
    return _finish(lo, hi, full_lo, full_hi)


def q_blocks_for(plan: Plan, masks: Masks, kj: Array) -> tuple[Array, ...]:
    """Query blocks that may see key block ``kj`` (backward pass)."""
    bq, bk, off = plan.block_q, plan.block_kv, plan.offset
    kj = jnp.asarray(kj, jnp.int32)
    first = kj * bk
    last = jnp.minimum(first + bk - 1, plan.kv_len - 1)
    lo_row = jnp.int32(0)
    hi_row = jnp.int32(plan.q_len)
    full_lo = jnp.int32(0)
    full_hi = jnp.int32(plan.n_q)
    # A tile is positionally full only if its keys are all real and in range.
    full_keys = first + bk <= plan.kv_len
    if plan.causal:
        lo_row = jnp.maximum(lo_row, first - off)
        full_lo = jnp.maximum(full_lo, _ceil_div(first + bk - 1 - off, bq))
    if plan.right is not None:
        lo_row = jnp.maximum(lo_row, first - off - plan.right)
        full_lo = jnp.maximum(full_lo, _ceil_div(first + bk - 1 - off - plan.right, bq))
    if plan.left is not None:
        hi_row = jnp.minimum(hi_row, last + plan.left - off + 1)
        full_hi = jnp.minimum(full_hi, (first + plan.left - off + 1) // bq)
    if masks.q_len is not None:
        hi_row = jnp.minimum(hi_row, jnp.max(masks.q_len))
    if masks.kv_len is not None:
        hi_row = jnp.where(first < jnp.max(masks.kv_len), hi_row, lo_row)
        full_keys = full_keys & (first + bk <= jnp.min(masks.kv_len))
    lo = lo_row // bq
    hi = jnp.where(hi_row > lo_row, _ceil_div(hi_row, bq), lo)
    full_hi = jnp.where(full_keys, full_hi, full_lo)
    return _finish(lo, hi, full_lo, full_hi)


def has_positional_mask(plan: Plan, masks: Masks) -> bool:
    """Whether any tile can be cut by causal, window, kv padding or kv_lengths."""
    return (
        plan.causal
        or plan.window is not None
        or plan.kv_len % plan.block_kv != 0
        or masks.kv_len is not None
    )


def visit(
    bounds: tuple[Array, ...],
    body: Callable[[Array, Any, bool], Any],
    carry: Any,
    positional: bool,
) -> Any:
    """Run ``body(block, carry, positional)`` over the blocks of ``bounds``.

    Edge blocks (``[lo, full_lo)`` and ``[full_hi, hi)``) run in one loop with
    the positional mask, full blocks in another without it; with
    ``positional=False`` there are no edge blocks and one loop suffices.
    """
    lo, full_lo, full_hi, hi = bounds
    if not positional:
        return lax.fori_loop(lo, hi, lambda i, c: body(i, c, False), carry)
    head = full_lo - lo

    def edge(t: Array, c: Any) -> Any:
        return body(jnp.where(t < head, lo + t, full_hi + t - head), c, True)

    carry = lax.fori_loop(0, head + hi - full_hi, edge, carry)
    return lax.fori_loop(full_lo, full_hi, lambda i, c: body(i, c, False), carry)
