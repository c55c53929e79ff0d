"""Dense attention: materialise every logit in float32 (float64 for a float64 call),
mask, softmax, done."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from attn_backends import AttentionCall, Operands

_HIGHEST = jax.lax.Precision.HIGHEST


def visible(call: AttentionCall, ops: Operands) -> jax.Array:
    """Boolean ``[B|1, Hq|1, Tq, Tk]``: key j visible to query i (docs/DESIGN.md, section 2)."""
    i = jnp.arange(call.q_len)[:, None]
    j = jnp.arange(call.kv_len)[None, :]
    diag = i + call.offset
    pos = jnp.ones((call.q_len, call.kv_len), bool)
    if call.causal:
        pos &= j <= diag
    if call.window is not None:
        left, right = call.window
        if left is not None:
            pos &= j >= diag - left
        if right is not None:
            pos &= j <= diag + right
    vis = pos[None, None]
    if ops.q_segment_ids is not None:
        same = ops.q_segment_ids[:, :, None] == ops.kv_segment_ids[:, None, :]
        vis = vis & same[:, None]
    if ops.kv_lengths is not None:
        vis = vis & (j[None] < ops.kv_lengths[:, None, None])[:, None]
    if ops.q_lengths is not None:
        vis = vis & (i[None] < ops.q_lengths[:, None, None])[:, None]
    if ops.mask is not None:
        vis = vis & ops.mask
    return vis


def dense_attention(call: AttentionCall, q: Any, k: Any, v: Any, ops: Operands) -> Any:
    """q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` -> out (, lse);
    k and v quantized (``call.kv_dtype``) are read as ``value * scale``
    (``ops.k_scales``, ``ops.v_scales`` ``[B, Tk, Hkv]``).

    Dropout multiplies the probabilities by ``keep / (1 - rate)`` with the whole
    keep-mask drawn at once (``attn_backends.authoring.dropout_keep``); lse is
    that of the undropped logits."""
    b, tq, hq, d = q.shape
    hkv, group = call.kv_heads, call.group
    wide = jnp.dtype(call.accumulation_dtype)
    if call.kv_dtype is not None:  # quantized: the attention of value * scale
        from attn_backends.authoring import dequantize

        k, v = dequantize(k, ops.k_scales, wide), dequantize(v, ops.v_scales, wide)
    # Group query heads by the kv head they read (h = kv_head * group + g), so
    # K and V are never repeated.
    qg = q.astype(wide).reshape(b, tq, hkv, group, d)
    logits = jnp.einsum(
        "bqkgd,bskd->bkgqs", qg, k.astype(wide), precision=_HIGHEST
    ).reshape(b, hq, tq, call.kv_len)
    logits = logits * call.scale
    if call.softcap is not None:
        logits = call.softcap * jnp.tanh(logits / call.softcap)
    if ops.bias is not None:
        logits = logits + ops.bias.astype(wide)
    vis = jnp.broadcast_to(visible(call, ops), logits.shape)
    any_visible = vis.any(axis=-1, keepdims=True)
    row_max = jnp.max(jnp.where(vis, logits, -jnp.inf), axis=-1, keepdims=True)
    # The max only stabilises exp(); its gradient cancels exactly, and for a
    # fully masked row (max = -inf) it would be NaN, so it is held constant.
    row_max = jax.lax.stop_gradient(jnp.where(any_visible, row_max, 0.0))
    unnorm = jnp.exp(jnp.where(vis, logits - row_max, -jnp.inf))
    total = unnorm.sum(axis=-1, keepdims=True)
    safe_total = jnp.where(any_visible, total, 1.0)
    probs = unnorm / safe_total
    if call.dropout_rate:
        from attn_backends.authoring import dropout_keep

        keep = dropout_keep(call, ops.dropout_key)
        probs = jnp.where(keep, probs / (1.0 - call.dropout_rate), 0.0)
    out = jnp.einsum(
        "bkgqs,bskd->bqkgd",
        probs.reshape(b, hkv, group, tq, call.kv_len),
        v.astype(wide),
        precision=_HIGHEST,
    ).reshape(b, tq, hq, call.v_head_dim)
    out = out.astype(q.dtype)
    if not call.return_lse:
        return out
    lse = jnp.where(any_visible, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
    return out, lse
