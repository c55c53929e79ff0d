"""The differentiable blockwise attention: layouts in, custom VJP, layouts out."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from attn_backends import AttentionCall, Operands

from ._backward import xla_native_backward
from ._config import BlockConfig
from ._forward import xla_native_forward
from ._plan import (
    Masks,
    Plan,
    decode_suits,
    kv_from_blocks,
    kv_to_blocks,
    pad_axis,
    pairwise_from_padded,
    pairwise_to_padded,
    prepare_masks,
    q_from_blocks,
    q_to_blocks,
    rows_to_blocks,
)

Array = Any


def blockwise_attention(
    call: AttentionCall,
    q: Array,
    k: Array,
    v: Array,
    operands: Operands,
    blocks: BlockConfig,
) -> tuple[Array, Array]:
    """Attention for a validated ``call``: out ``[B, Tq, Hq, Dv]`` (q's
    dtype) and lse ``[B, Hq, Tq]`` float32, differentiable in q, k, v, bias.

    Calls with a few query positions go to the decode path, which has no
    blocks (nor dropout, nor a quantized K and V: those calls stay on the
    blocks); ``blocks`` serve the rest. A quantized K and V (``call.kv_dtype``,
    their scales in ``operands``) run the forward alone."""
    if decode_suits(call) and not call.dropout_rate and call.kv_dtype is None:
        from ._decode import decode_attention

        return decode_attention(call, q, k, v, operands)
    plan = Plan.of(call, blocks)
    masks = prepare_masks(plan, operands)
    seed = None
    if call.dropout_rate:
        from attn_backends.authoring import dropout_seed

        seed = dropout_seed(operands.dropout_key)
    if call.kv_dtype is not None:  # quantized K, V: forward only (core guards gradients)
        scales = (kv_to_blocks(plan, operands.k_scales[..., None]).swapaxes(-1, -2),
                  pad_axis(operands.v_scales[..., None], 1, plan.n_kv * plan.block_kv))
        return _forward(plan, q, k, v, operands.bias, masks, seed, scales)
    bwd_plan = Plan.of(call, blocks.backward())
    bwd_masks = masks if bwd_plan == plan else prepare_masks(bwd_plan, operands)
    return _attention(plan, bwd_plan, q, k, v, operands.bias, masks, bwd_masks, seed)


# Jitted under fixed names: the names appear in the lowered program as called
# functions, so one can tell this kernel ran (``Backend.hlo_marker``).
_forward_jit = jax.jit(xla_native_forward, static_argnums=(0, 1))
_backward_jit = jax.jit(xla_native_backward, static_argnums=(0, 9))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(
    plan: Plan,
    bwd_plan: Plan,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    masks: Masks,
    bwd_masks: Masks,
    seed: Array | None,
) -> tuple[Array, Array]:
    return _attention_fwd(plan, bwd_plan, q, k, v, bias, masks, bwd_masks, seed)[0]


def _attention_fwd(
    plan: Plan,
    bwd_plan: Plan,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    masks: Masks,
    bwd_masks: Masks,
    seed: Array | None,
) -> tuple[tuple[Array, Array], tuple]:
    out, lse = _forward(plan, q, k, v, bias, masks, seed)
    # Only the caller's arrays, the output and lse are kept: the backward
    # pass may use other blocks and builds its own layouts.
    residuals = (q, k, v, bias, bwd_masks, seed, out, lse)
    return (out, lse), residuals


def _forward(plan: Plan, q: Array, k: Array, v: Array, bias: Array | None, masks: Masks,
             seed: Array | None, scales: tuple[Array, Array] | None = None
             ) -> tuple[Array, Array]:
    """out ``[B, Tq, Hq, Dv]`` and lse ``[B, Hq, Tq]`` of the caller's arrays
    (``xla_native_forward``'s ``scales`` for a quantized K and V)."""
    # K is kept transposed, [n_kv, B, Hkv, D, block_kv], so q.k is a plain NN
    # matmul in every tile. q and the output stay in the caller's layout.
    k_t = kv_to_blocks(plan, k).swapaxes(-1, -2)
    v_p = pad_axis(v, 1, plan.n_kv * plan.block_kv)
    bias_p = None if bias is None else pairwise_to_padded(plan, bias, 0)
    folded, q_scale = _fold_scale(plan)
    q_p = pad_axis(q, 1, plan.n_q * plan.block_q)
    out, lse = _forward_jit(folded, q_scale, q_p, k_t, v_p, bias_p, masks, seed, scales)
    return out[:, : plan.q_len], lse[..., : plan.q_len]


def _fold_scale(plan: Plan) -> tuple[Plan, float]:
    """Scale q once instead of every logits tile, where that is exact enough:
    in float32 or float64, or for a power-of-two scale of at most 1 (exact in any float
    format, and it cannot overflow a narrow q the way a scale of 4 can).
    Returns the plan to run with (scale 1 when folded) and the factor to
    apply to q (1 when not folded)."""
    exact = math.frexp(plan.scale)[0] == 0.5 and abs(plan.scale) <= 1.0
    if plan.dtype not in ("float32", "float64") and not exact:
        return plan, 1.0
    return replace(plan, scale=1.0), plan.scale


def _attention_bwd(_forward_plan: Plan, plan: Plan, residuals: tuple, cotangents: tuple) -> tuple:
    q, k, v, bias, masks, seed, out, lse = residuals
    k_t = kv_to_blocks(plan, k).swapaxes(-1, -2)
    bias_p = None if bias is None else pairwise_to_padded(plan, bias, 0)
    d_out, d_lse = cotangents
    folded, q_scale = _fold_scale(plan)
    q_b = q_to_blocks(plan, (q * jnp.asarray(q_scale, q.dtype)).astype(q.dtype))
    d_out = d_out.astype(q.dtype)
    do_b = q_to_blocks(plan, d_out)
    delta = jnp.sum(d_out.astype(plan.acc) * out.astype(plan.acc), axis=-1)
    delta = rows_to_blocks(plan, delta.transpose(0, 2, 1) - d_lse.astype(plan.acc))
    # +inf lse zeroes the probabilities (and so every gradient) of rows that
    # see no key and of padding rows, whatever their logits are.
    lse_b = rows_to_blocks(plan, lse)
    row = jnp.arange(plan.rows, dtype=jnp.int32) % plan.block_q
    pos = jnp.arange(plan.n_q, dtype=jnp.int32)[:, None] * plan.block_q + row
    padding = (pos >= plan.q_len)[:, None, None, :]
    lse_b = jnp.where(jnp.isneginf(lse_b) | padding, jnp.inf, lse_b)
    # With the scale folded into q, the kernel's dK (ds^T q) is already
    # scaled and its dQ (ds k) still needs the scale.
    v_p = pad_axis(v, 1, plan.n_kv * plan.block_kv)
    dq, dk, dv, dbias = _backward_jit(
        folded, q_b, k_t, v_p, bias_p, masks, do_b, lse_b, delta, bias_p is not None, seed
    )
    grads = (
        q_from_blocks(plan, dq * plan.acc(q_scale)).astype(q.dtype),
        kv_from_blocks(plan, dk).astype(k.dtype),
        kv_from_blocks(plan, dv).astype(v.dtype),
        None if dbias is None else pairwise_from_padded(plan, dbias).astype(bias.dtype),
        None,
        None,
        None,
    )
    return grads


_attention.defvjp(_attention_fwd, _attention_bwd)
