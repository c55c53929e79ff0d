"""Turning the contract's visibility rules into what splash understands.

Static structure (causal, window; both aligned bottom-right by ``Tk - Tq``)
becomes one band, which ``_kernel`` turns into a splash mask object that the
kernel evaluates in-kernel and uses to skip fully masked blocks. Everything
that varies per example (segment ids, ``kv_lengths``, and the padding the block
sizes force on Tk) becomes segment ids:
a key is visible only when its id equals the query's id, so invisible keys get
an id that no query of that example holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from attn_backends.authoring import AttentionCall, Operands


def static_window(call: AttentionCall) -> tuple[int | None, int | None] | None:
    """The (left, right) band that causal and window impose together; None if unbounded.

    Causal is the band's right side at 0, so ``causal`` + ``window=(l, r)`` is
    the band ``(l, min(r, 0))``: one kernel mask instead of two.
    """
    left, right = call.window if call.window is not None else (None, None)
    if call.causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    return left, right


def needs_segment_ids(call: AttentionCall, kv_len_padded: int) -> bool:
    """Whether per-example masking is needed: user ids, kv_lengths, or kv padding.

    Padded keys need masking unless causal already hides them: a real row i sees
    at most key ``i + Tk - Tq <= Tk - 1``.
    """
    padded_visible = kv_len_padded > call.kv_len and not call.causal
    return call.segment_ids or call.kv_lengths or padded_visible


def segment_ids(
    call: AttentionCall, operands: Operands, q_len: int, kv_len: int
) -> tuple[Any, Any]:
    """int32 ids ``q [B, q_len]`` and ``kv [B, kv_len]`` over the padded lengths.

    Keys at ``j >= kv_lengths[b]`` or in the padding get an id absent from the
    example's query ids: ``min(q_ids) - 1``, or ``max(q_ids) + 1`` when the
    minimum is already the smallest int32 (ids spanning the whole int32 range are
    the one case this cannot separate).
    """
    import jax.numpy as jnp

    b, tq, tk = call.batch, call.q_len, call.kv_len
    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    kv_valid = jnp.broadcast_to(kv_pos < tk, (b, kv_len))
    if operands.kv_lengths is not None:
        kv_valid = kv_valid & (kv_pos < operands.kv_lengths.astype(jnp.int32)[:, None])
    if operands.q_segment_ids is None:
        q_ids = jnp.zeros((b, q_len), jnp.int32)
        kv_ids = jnp.where(kv_valid, 0, 1).astype(jnp.int32)
        return q_ids, kv_ids
    q_real = operands.q_segment_ids.astype(jnp.int32)
    kv_real = operands.kv_segment_ids.astype(jnp.int32)
    smallest = np.iinfo(np.int32).min
    low, high = q_real.min(axis=1), q_real.max(axis=1)
    absent = jnp.where(low > smallest, low - 1, high + 1)[:, None]
    # Padded query rows are dropped after the kernel; their id does not matter.
    q_ids = jnp.pad(q_real, ((0, 0), (0, q_len - tq)))
    kv_ids = jnp.where(kv_valid, jnp.pad(kv_real, ((0, 0), (0, kv_len - tk))), absent)
    return q_ids, kv_ids
