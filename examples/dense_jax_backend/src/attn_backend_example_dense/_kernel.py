"""The computation: one visibility mask, then ``jax.nn.dot_product_attention``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from attn_backends.authoring import AttentionCall, Operands


def _visible(call: AttentionCall, ops: Operands) -> jax.Array:
    """Boolean ``[B|1, Hq|1, Tq, Tk]``: causal (bottom-right), kv lengths, mask."""
    vis = jnp.ones((1, 1, call.q_len, call.kv_len), bool)
    if call.causal:
        rows = jnp.arange(call.q_len)[:, None] + call.offset
        vis &= jnp.arange(call.kv_len)[None, :] <= rows
    if ops.kv_lengths is not None:
        vis &= (jnp.arange(call.kv_len)[None, :] < ops.kv_lengths[:, None])[:, None, None]
    if ops.q_lengths is not None:
        vis &= (jnp.arange(call.q_len)[None, :] < ops.q_lengths[:, None])[:, None, :, None]
    if ops.mask is not None:
        vis &= ops.mask
    return vis


def attention(call: AttentionCall, q: Any, k: Any, v: Any, ops: Operands) -> jax.Array:
    """Contract attention: q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``.

    Returns out ``[B, Tq, Hq, Dv]`` in q's dtype.

    Inputs are already validated (``attn_backends.bind``).
    """
    vis = _visible(call, ops)
    bias = None if ops.bias is None else ops.bias.astype(q.dtype)
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=vis, scale=call.scale, implementation="xla"
    )
    # jax.nn gives a row with no visible key the mean of v; the contract says
    # zeros (and zero gradients, which `where` provides).
    seen = jnp.any(vis, axis=-1)  # [B|1, Hq|1, Tq]
    seen = jnp.broadcast_to(seen, (call.batch, call.q_heads, call.q_len))
    return jnp.where(seen.transpose(0, 2, 1)[..., None], out, jnp.zeros((), out.dtype))
