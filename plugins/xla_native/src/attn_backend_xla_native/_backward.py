"""Backward pass (FlashAttention-2 style): recompute each tile's
probabilities from the saved lse instead of storing the S x S matrix.

The outer loop runs over key blocks and keeps that block's dK, dV in the
loop carry; the inner loop visits only the query blocks that can see it
and adds into a carried, transposed dQ (float32, linear in the sequence).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from attn_backends.authoring import vary_like
from jax import lax

from ._plan import Masks, Plan, kv_block, tile_keep, visibility
from ._ranges import has_positional_mask, q_blocks_for, visit
from ._tile import dot_nn, logits_t

Array = Any


def _bias_tile_grad(plan: Plan, ds: Array, bias_shape: tuple[int, ...]) -> Array:
    """Sum a ``[B, Hkv, rows, block_kv]`` tile gradient to the bias's
    broadcast layout ``[B|1, Hkv|1, G|1, block_q, block_kv]``."""
    ds = ds.reshape(ds.shape[0], ds.shape[1], plan.group, plan.block_q, plan.block_kv)
    axes = tuple(i for i in range(3) if bias_shape[i] == 1 and ds.shape[i] != 1)
    return ds.sum(axis=axes, keepdims=True) if axes else ds


def xla_native_backward(
    plan: Plan,
    q: Array,
    k_t: Array,
    v: Array,
    bias: Array | None,
    masks: Masks,
    d_out: Array,
    lse: Array,
    delta: Array,
    bias_grad: bool,
    seed: Array | None = None,
) -> tuple[Array, Array, Array, Array | None]:
    """Gradients of the blocked forward.

    q and ``d_out`` blocked ``[n_q, B, Hkv, rows, E]``, k transposed ``[n_kv,
    B, Hkv, D, block_kv]``, v padded in the caller's layout ``[B, Tk_pad,
    Hkv, Dv]`` (each key block's tile is cut from it as the loop reaches
    it), ``lse`` and ``delta`` (``rowsum(d_out * out) - d_lse``) ``[n_q, B,
    Hkv, rows]`` float32, with lse ``+inf`` on rows whose gradient must be
    zero (no visible key, padding). ``seed`` draws each tile's dropout keep
    bits again, exactly as the forward drew them. Returns dq, dk, dv (float32, blocked)
    and the padded bias gradient (float32) or None.
    """
    dtype = q.dtype
    # Inside a user's shard_map every carry varies as the inputs do (check_vma).
    inputs = (q, k_t, v, bias, d_out, lse, delta)
    # float16 tops out at 65504, which logit gradients pass under loss
    # scaling even when dq and dk fit: its products stay float32.
    ds_dtype = plan.acc if dtype == jnp.float16 else dtype
    # The pass works on transposed tiles [block_kv, rows] so that all five
    # matmuls are NN; dQ is accumulated transposed, [n_q, B, Hkv, D, rows].
    # q and d_out are transposed per tile rather than copied whole: two
    # sequence-long copies fewer (issue 4's 1 GiB budget at S=65536).

    def one_key_block(carry: tuple, args: tuple) -> tuple:
        kj, k_t_tile = args
        k_tile = k_t_tile.swapaxes(-1, -2)
        k_t_wide = k_t_tile.astype(ds_dtype)  # once per key block, not per tile
        v_tile = kv_block(plan, v, kj)

        def body(qi: Array, inner: tuple, positional: bool) -> tuple:
            dk, dv, dq_t, dbias = inner
            q_tile = lax.dynamic_index_in_dim(q, qi, keepdims=False)
            q_t_tile = q_tile.swapaxes(-1, -2)
            do_tile = lax.dynamic_index_in_dim(d_out, qi, keepdims=False)
            do_t_tile = do_tile.swapaxes(-1, -2)
            lse_tile = lax.dynamic_index_in_dim(lse, qi, keepdims=False)[..., None, :]
            delta_tile = lax.dynamic_index_in_dim(delta, qi, keepdims=False)[..., None, :]
            s_t, capped_t = logits_t(plan, k_tile, q_t_tile, bias, qi, kj)
            p_t = jnp.exp(s_t - lse_tile)
            vis = visibility(plan, masks, qi, kj, positional)
            vis_t = None if vis is None else vis.swapaxes(-1, -2)
            if vis_t is not None:
                p_t = jnp.where(vis_t, p_t, 0.0)
            dp_t = dot_nn(v_tile, do_t_tile)
            if plan.dropout_rate:
                # out = (P * keep / (1 - rate)) V: dV sees the dropped weights,
                # dP the dropped gradient; delta = rowsum(dO * out) already is.
                drop_t = jnp.where(tile_keep(plan, seed, qi, kj).swapaxes(-1, -2),
                                   jnp.float32(1.0 / (1.0 - plan.dropout_rate)), 0.0)
                dv = dv + dot_nn((p_t * drop_t).astype(dtype), do_tile)
                dp_t = dp_t * drop_t
            else:
                dv = dv + dot_nn(p_t.astype(dtype), do_tile)
            ds_t = p_t * (dp_t - delta_tile)
            if vis_t is not None:
                # Hidden keys may hold garbage V: 0 * inf must not become NaN.
                ds_t = jnp.where(vis_t, ds_t, 0.0)
            if dbias is not None:
                tile = _bias_tile_grad(plan, ds_t.swapaxes(-1, -2), dbias.shape)
                zero = jnp.int32(0)  # one index type with qi and kj, x64 or not
                start = (zero, zero, zero, qi * plan.block_q, kj * plan.block_kv)
                dbias = lax.dynamic_update_slice(dbias, tile, start)
            if capped_t is not None:
                ds_t = ds_t * (1.0 - capped_t * capped_t)
            ds_t = ds_t.astype(ds_dtype)
            dk = dk + dot_nn(ds_t, q_tile.astype(ds_dtype))
            dq_t_tile = lax.dynamic_index_in_dim(dq_t, qi, keepdims=False) + dot_nn(k_t_wide, ds_t)
            dq_t = lax.dynamic_update_index_in_dim(dq_t, dq_t_tile, qi, 0)
            return dk, dv, dq_t, dbias

        dq_t, dbias = carry
        inner = (
            *vary_like((jnp.zeros(k_tile.shape, plan.acc), jnp.zeros(v_tile.shape, plan.acc)),
                       *inputs),
            dq_t,
            dbias,
        )
        bounds = q_blocks_for(plan, masks, kj)
        dk, dv, dq_t, dbias = visit(bounds, body, inner, has_positional_mask(plan, masks))
        return (dq_t, dbias), (dk, dv)

    dq_t = vary_like(jnp.zeros(q.swapaxes(-1, -2).shape, plan.acc), *inputs)
    dbias = None
    if bias_grad and bias is not None:
        dbias = vary_like(jnp.zeros(bias.shape, plan.acc), *inputs)
    kv_index = jnp.arange(plan.n_kv, dtype=jnp.int32)
    (dq_t, dbias), (dk, dv) = lax.scan(one_key_block, (dq_t, dbias), (kv_index, k_t))
    scale = plan.acc(plan.scale)
    return dq_t.swapaxes(-1, -2) * scale, dk * scale, dv, dbias
