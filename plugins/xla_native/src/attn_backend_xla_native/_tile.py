"""One tile of logits and the batched matmuls the kernel is made of.

Matmuls run in the input dtype with float32 accumulation (float64 for float64)
(``preferred_element_type``), batched over ``(B, Hkv)``, and are all plain
NN products: XLA's CPU matmul is about twice as slow with a transposed
left operand.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from ._plan import Plan, pairwise_block

Array = Any
_BATCH = ((0, 1), (0, 1))


def _wide(a: Array, b: Array) -> Any:
    """float32, or float64 when an operand is float64 (a float64 call, x64)."""
    return jnp.promote_types(jnp.result_type(a, b), jnp.float32)


def _dot(a: Array, b: Array) -> Array:
    return lax.dot_general(a, b, (((3,), (2,)), _BATCH), preferred_element_type=_wide(a, b))


def _dot_widened(a: Array, b: Array) -> Array:
    return _dot(a.astype(jnp.float32), b.astype(jnp.float32))


def dot_nn(a: Array, b: Array) -> Array:
    """``[B, H, M, K] x [B, H, K, N] -> [B, H, M, N]`` float32 (float64 if an operand is)."""
    if a.dtype.itemsize >= 4 and b.dtype.itemsize >= 4:
        return _dot(a, b)
    # XLA's CPU runtime lacks a kernel for some bf16/f16 x bf16/f16 -> f32
    # dots ("Unsupported element type for DotThunk"), so on CPU the operands
    # are widened first; on GPU/TPU the narrow inputs feed the matrix units.
    return lax.platform_dependent(a, b, cpu=_dot_widened, default=_dot)


def _finish(plan: Plan, product: Array, bias_tile: Array | None) -> tuple[Array, Array | None]:
    s = product * plan.acc(plan.scale)
    capped = None
    if plan.softcap is not None:
        capped = jnp.tanh(s * plan.acc(1.0 / plan.softcap))
        s = capped * plan.acc(plan.softcap)
    if bias_tile is not None:
        s = s + bias_tile.astype(plan.acc)
    return s, capped


def logits(
    plan: Plan, q_tile: Array, k_t_tile: Array, bias: Array | None, qi: Array, kj: Array
) -> tuple[Array, Array | None]:
    """Logits of tile ``(qi, kj)``: ``[B, Hkv, rows, block_kv]`` float32.

    ``k_t_tile`` is K transposed, ``[B, Hkv, D, block_kv]``, so the product
    is a plain NN matmul (transposed operands are slower on CPU). Also
    returns ``tanh(scale * q.k / softcap)`` when softcap is on (the backward
    pass needs it for the softcap derivative), else None.
    """
    bias_tile = None if bias is None else pairwise_block(plan, bias, qi, kj)
    return _finish(plan, dot_nn(q_tile, k_t_tile), bias_tile)


def logits_t(
    plan: Plan, k_tile: Array, q_t_tile: Array, bias: Array | None, qi: Array, kj: Array
) -> tuple[Array, Array | None]:
    """Transposed logits of tile ``(qi, kj)``: ``[B, Hkv, block_kv, rows]``,
    from k ``[B, Hkv, block_kv, D]`` and q transposed ``[B, Hkv, D, rows]``;
    the backward pass works in this orientation so all its matmuls are NN."""
    bias_tile = None
    if bias is not None:
        bias_tile = pairwise_block(plan, bias, qi, kj).swapaxes(-1, -2)
    return _finish(plan, dot_nn(k_tile, q_t_tile), bias_tile)
