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
    kv_from_blocks,
    kv_to_blocks,
    pairwise_from_padded,
    pairwise_to_padded,
    prepare_masks,
    q_from_blocks,
    q_to_blocks,
    rows_from_blocks,
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
    dtype) and lse ``[B, Hq, Tq]`` float32, differentiable in q, k, v, bias."""
    plan = Plan.of(call, blocks)
    masks = prepare_masks(plan, operands)
    return _attention(plan, q, k, v, operands.bias, masks)


# Jitted under fixed names: the names appear in the lowered program as called
# functions, so one can tell this kernel ran (``Backend.hlo_marker``).
_forward_jit = jax.jit(xla_native_forward, static_argnums=0)
_backward_jit = jax.jit(xla_native_backward, static_argnums=(0, 9))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(
    plan: Plan, q: Array, k: Array, v: Array, bias: Array | None, masks: Masks
) -> tuple[Array, Array]:
    return _attention_fwd(plan, q, k, v, bias, masks)[0]


def _attention_fwd(
    plan: Plan, q: Array, k: Array, v: Array, bias: Array | None, masks: Masks
) -> tuple[tuple[Array, Array], tuple]:
    # K is kept transposed, [n_kv, B, Hkv, D, block_kv], so q.k is a plain NN
    # matmul in every tile.
    q_b, v_b = q_to_blocks(plan, q), kv_to_blocks(plan, v)
    k_t = kv_to_blocks(plan, k).swapaxes(-1, -2)
    bias_p = None if bias is None else pairwise_to_padded(plan, bias, 0)
    folded, q_b = _fold_scale(plan, q_b)
    out_b, lse_b = _forward_jit(folded, q_b, k_t, v_b, bias_p, masks)
    out = q_from_blocks(plan, out_b)
    lse = rows_from_blocks(plan, lse_b)
    residuals = (q_b, k_t, v_b, bias_p, masks, out_b, lse_b)
    return (out, lse), residuals


def _fold_scale(plan: Plan, q_b: Array | None) -> tuple[Plan, Array | None]:
    """Scale q once instead of every logits tile, where that is exact enough:
    in float32, or for a power-of-two scale (exact in any float format).
    Returns the plan to run with (scale 1 when folded) and the scaled q."""
    exact = math.frexp(plan.scale)[0] == 0.5
    if plan.dtype != "float32" and not exact:
        return plan, q_b
    if q_b is not None:
        q_b = (q_b * jnp.asarray(plan.scale, q_b.dtype)).astype(q_b.dtype)
    return replace(plan, scale=1.0), q_b


def _attention_bwd(plan: Plan, residuals: tuple, cotangents: tuple) -> tuple:
    q_b, k_t, v_b, bias_p, masks, out_b, lse_b = residuals
    d_out, d_lse = cotangents
    do_b = q_to_blocks(plan, d_out.astype(q_b.dtype))
    delta = jnp.sum(do_b.astype(jnp.float32) * out_b.astype(jnp.float32), axis=-1)
    delta = delta - rows_to_blocks(plan, d_lse.astype(jnp.float32))
    # +inf lse zeroes the probabilities (and so every gradient) of rows that
    # see no key and of padding rows, whatever their logits are.
    row = jnp.arange(plan.rows, dtype=jnp.int32) % plan.block_q
    pos = jnp.arange(plan.n_q, dtype=jnp.int32)[:, None] * plan.block_q + row
    padding = (pos >= plan.q_len)[:, None, None, :]
    lse_b = jnp.where(jnp.isneginf(lse_b) | padding, jnp.inf, lse_b)
    # With the scale folded into the saved q, the kernel's dK (ds^T q) is
    # already scaled and its dQ (ds k) still needs the scale.
    folded, _ = _fold_scale(plan, None)
    dq, dk, dv, dbias = _backward_jit(
        folded, q_b, k_t, v_b, bias_p, masks, do_b, lse_b, delta, bias_p is not None
    )
    dq_scale = plan.scale / folded.scale
    grads = (
        q_from_blocks(plan, dq * jnp.float32(dq_scale)).astype(q_b.dtype),
        kv_from_blocks(plan, dk).astype(k_t.dtype),
        kv_from_blocks(plan, dv).astype(v_b.dtype),
        None if dbias is None else pairwise_from_padded(plan, dbias).astype(bias_p.dtype),
        None,
    )
    return grads


_attention.defvjp(_attention_fwd, _attention_bwd)
