"""The mapping from a contract call to ``jax.nn.dot_product_attention(implementation="cudnn")``.

Imported lazily (from ``attend``).

What cuDNN (through jax.nn) takes natively: BTNH with GQA, ``is_causal``
(top-left, so used only when Tq == Tk, where it equals the contract's
bottom-right), key lengths (its padding mask), an additive bias and a boolean
mask (which jax.nn turns into a bias). Everything else that hides keys
(bottom-right causal for Tq != Tk, windows, segment ids) becomes one boolean
visibility mask ``[B|1, Hq|1, Tq, Tk]``, built from iotas and ids.

Rows that see no key: cuDNN's result for them is not specified (a bias-masked
row averages v; a padding-masked one may divide by zero, and a NaN there would
reach dk and dv through the backward). So no row the kernel gets is empty: an
empty row is given every key (and a batch with ``kv_lengths`` 0 its full
length), then its output is replaced by zeros, which also makes its cotangent
zero, so it adds nothing to any gradient. Rows past ``q_lengths`` are zeroed
the same way (they are computed, not handed to cuDNN's query padding).

With a bias or mask, cuDNN's backward needs even Tq and Tk: odd lengths get one
padding row and key (the key hidden by the key lengths, the row cut off).
"""

from __future__ import annotations

from typing import Any

from attn_backends.authoring import AttentionCall, Operands


def _band(call: AttentionCall, jnp: Any) -> Any:
    """``[1, 1, Tq, Tk]`` causal/window visibility, aligned bottom-right; None if neither."""
    if not call.causal and call.window is None:
        return None
    i = jnp.arange(call.q_len)[:, None] + call.offset
    j = jnp.arange(call.kv_len)[None, :]
    visible = jnp.ones((call.q_len, call.kv_len), bool)
    if call.causal:
        visible &= j <= i
    if call.window is not None:
        left, right = call.window
        if left is not None:
            visible &= j >= i - left
        if right is not None:
            visible &= j <= i + right
    return visible[None, None]


def _dense_mask(call: AttentionCall, operands: Operands, jnp: Any) -> Any:
    """Every dense visibility condition ANDed, ``[B|1, Hq|1, Tq, Tk]``; None if none.

    Causal is folded in whenever the mask exists (even when cuDNN also gets
    ``is_causal``), so the empty rows found from the mask are exactly right.
    """
    parts = []
    needs_dense = (call.window is not None or call.segment_ids or call.mask_shape is not None
                   or (call.causal and call.q_len != call.kv_len))
    if not needs_dense:
        return None
    band = _band(call, jnp)
    if band is not None:
        parts.append(band)
    if call.segment_ids:
        q_ids, kv_ids = operands.q_segment_ids, operands.kv_segment_ids
        parts.append((q_ids[:, :, None] == kv_ids[:, None, :])[:, None])
    if operands.mask is not None:
        parts.append(operands.mask)
    mask = parts[0]
    for part in parts[1:]:
        mask = mask & part
    return mask


def run(call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
        implementation: str = "cudnn") -> Any:
    """Attention for a call ``check()`` accepted; q ``[B, Tq, Hq, D]`` -> ``[B, Tq, Hq, D]``.

    ``implementation`` is jax.nn's: "cudnn" in the backend; the tests pass "xla"
    to check this mapping on a machine without cuDNN.
    """
    import jax
    import jax.numpy as jnp

    b, tq, tk = call.batch, call.q_len, call.kv_len
    mask = _dense_mask(call, operands, jnp)
    kv_lengths = operands.kv_lengths
    key_seen = None  # [B, 1, 1, Tk]: keys inside kv_lengths
    if kv_lengths is not None:
        key_seen = (jnp.arange(tk)[None, :] < kv_lengths[:, None])[:, None, None, :]

    # dead: [B, Hq|1, Tq] rows that see no key.
    if mask is not None:
        seen = mask if key_seen is None else mask & key_seen
        dead = ~jnp.any(seen, axis=-1)
        mask = mask | dead[..., None]
    elif kv_lengths is not None:
        dead = jnp.broadcast_to((kv_lengths <= 0)[:, None, None], (b, 1, tq))
    else:
        dead = None
    if kv_lengths is not None:
        # An empty batch entry is given every key; its rows are all dead and zeroed.
        kv_lengths = jnp.where(kv_lengths <= 0, tk, jnp.minimum(kv_lengths, tk))
    bias = operands.bias  # in q's dtype: check() declines any other

    pad_q = tq % 2 if (bias is not None or mask is not None) else 0
    pad_k = tk % 2 if (bias is not None or mask is not None) else 0
    if pad_q or pad_k:
        def pad(x: Any, rows: int, axis: int, value: Any = 0) -> Any:
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, rows)
            return jnp.pad(x, widths, constant_values=value)

        q = pad(q, pad_q, 1)
        k, v = pad(k, pad_k, 1), pad(v, pad_k, 1)
        if mask is not None:
            # Padding rows see every key (never empty); the padding key is hidden
            # by the key lengths below.
            mask = pad(pad(mask, pad_q, 2, True), pad_k, 3, True)
        if bias is not None:
            bias = pad(pad(bias, pad_q, 2), pad_k, 3)
        if kv_lengths is None:
            kv_lengths = jnp.full((b,), tk, jnp.int32)

    out = jax.nn.dot_product_attention(
        q, k, v, bias, mask,
        scale=float(call.scale),
        is_causal=call.causal and tq == tk,
        key_value_seq_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
        implementation=implementation,
    )[:, :tq]
    zero_rows = None  # [B, Tq, Hq|1] True where the output must be 0
    if dead is not None:
        zero_rows = dead.transpose(0, 2, 1)
    if operands.q_lengths is not None:
        past = (jnp.arange(tq)[None, :] >= operands.q_lengths[:, None])[:, :, None]
        zero_rows = past if zero_rows is None else zero_rows | past
    if zero_rows is not None:
        out = jnp.where(zero_rows[..., None], jnp.zeros((), out.dtype), out)
    return out
