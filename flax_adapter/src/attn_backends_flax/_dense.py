"""The dense path of :mod:`attn_backends_flax` (its module doc, ``module``): a call
with ``sow_weights=True`` asks for the attention weights, which no registry
backend materialises; the adapter computes them here by the contract's rules,
with the output as their product with value, and sows them where flax's own
attention does. ``DENSE_PATH`` is public as ``attn_backends_flax.DENSE_PATH``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from attn_backends.contract.call import AttentionCall
from attn_backends.contract.errors import FallbackWarning, UnsupportedError, warn

#: The name ``served`` and ``explain()`` give the adapter's own path for ``sow_weights``.
DENSE_PATH = "attn_backends_flax dense path (sow_weights)"

#: sow_weights with dropout: the weights here are computed without a keep-mask.
SOWN_DROPOUT_REFUSED = (
    "attn_backends_flax: sow_weights=True with attention dropout (dropout_rate={rate}, "
    "deterministic=False) is not supported: the weights are computed by the adapter's dense "
    "path, which draws no dropout keep-mask. Sow the weights with deterministic=True, or "
    "train without sow_weights."
)


def announce_dense(fallback: str, signature: object) -> None:
    """The one word per signature (a ``FlaxSignature``, named in it) that the dense
    path serves a sown-weights call, as the attention's ``fallback`` asks."""
    message = (
        f"attn_backends_flax: the call {signature} asks for the attention weights, "
        "which no registry backend materialises; this call is served by the adapter's dense "
        "path (the contract's rules, float32 softmax), whose output is those weights times "
        "value. Calls without sow_weights go to the registry as before."
    )
    if fallback == "error":
        raise UnsupportedError(
            message + " (fallback='error': drop sow_weights, or get the attention with "
            "fallback='warn')"
        )
    if fallback != "silent":
        warn(message, FallbackWarning)


def dense(call: AttentionCall, q: jax.Array, k: jax.Array, v: jax.Array,
          mask: jax.Array | None, bias: jax.Array | None,
          precision: Any = None) -> tuple[jax.Array, jax.Array]:
    """The contract's attention, materialised: ``call`` as bound (causal and window
    aligned bottom-right, mask, bias, GQA; no softcap, ids or lengths, which the
    adapter never passes). q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk,
    Hkv, Dv]`` -> out ``[B, Tq, Hq, Dv]`` float32 and weights ``[B, Hq, Tq, Tk]``
    float32, out = weights @ v; a row with no visible key has zero weights.
    ``precision`` is flax's, for both matmuls, as flax's own attention uses it."""
    f32 = jnp.float32
    kk, vv = (jnp.repeat(x.astype(f32), call.group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), kk, precision=precision) * call.scale
    if bias is not None:
        s = s + bias.astype(f32)
    row = jnp.arange(call.q_len)[:, None] + call.offset
    col = jnp.arange(call.kv_len)[None, :]
    visible = jnp.ones((call.q_len, call.kv_len), bool)
    left, right = call.window or (None, None)
    if call.causal:
        visible &= col <= row
    if left is not None:
        visible &= col >= row - left
    if right is not None:
        visible &= col <= row + right
    if mask is not None:
        visible = visible & mask
    # Softmax over visible keys; the max is a constant shift (no gradient), and a
    # row that sees nothing gets zeros, never NaN.
    peak = jax.lax.stop_gradient(
        jnp.max(jnp.where(visible, s, -jnp.inf), -1, keepdims=True, initial=-jnp.inf)
    )
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    weights = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, vv, precision=precision), weights


def sow(module: Any, weights: jax.Array) -> None:
    """Sow ``weights`` where flax's own ``dot_product_attention`` does: linen's
    ``"intermediates"`` collection; nnx reads that name as ``nnx.Intermediate``
    (flax 0.12.8 and 0.12.12), where its own attention sows."""
    module.sow("intermediates", "attention_weights", weights)
