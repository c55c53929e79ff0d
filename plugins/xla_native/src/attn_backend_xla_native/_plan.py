"""Static plan of a blockwise call, block layouts and block visibility.

Internal layout: queries of one kv head and all its ``group`` query heads
form the rows of one tile, ordered (g, t): row ``r = g * block_q + t``. So
GQA/MQA reads each K/V block once for the whole group, without repeating
K/V. Blocked arrays are ``[n_blocks, B, Hkv, rows, ...]`` so a loop picks a
block with one dynamic index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
from attn_backends import AttentionCall, Operands
from jax import lax

from ._config import BlockConfig

Array = Any

# Most query positions a call may have for the decode path (``_decode.py``).
# From BENCHMARKS.md "Decode": the decode path reads the cache once per call
# whatever Tq is, but its per-key work grows with G * Tq, and the blockwise
# kernel's matmuls take over as Tq grows.
DECODE_MAX_Q = 8

# jaxlib before 0.12 miscompiles the decode path's fused products on cpu:
# forward errors of 0.3 to 1.6 on values of order 1 (Tq=6, Hq=8, Hkv=2,
# Tk=16; Tq=1, Tk=300), right op by op (jax.disable_jit) and right on jaxlib
# 0.12.0.1 for the same calls. There the blockwise kernel serves instead.
DECODE_MIN_JAXLIB = (0, 12)


def _jaxlib_at_least(version: tuple[int, int]) -> bool:
    import jaxlib

    found = tuple(int(part) for part in jaxlib.__version__.split(".")[:2])
    return found >= version


def decode_suits(call: AttentionCall) -> bool:
    """Whether ``call`` goes to the decode path rather than the blockwise
    kernel: at most ``DECODE_MAX_Q`` query positions, a non-empty cache and a
    jaxlib that compiles the path right (``DECODE_MIN_JAXLIB``)."""
    shape_fits = 1 <= call.q_len <= DECODE_MAX_Q and call.kv_len >= 1 and call.batch >= 1
    return shape_fits and _jaxlib_at_least(DECODE_MIN_JAXLIB)


@dataclass(frozen=True)
class Plan:
    """Everything static about one call: shapes, blocks, flags. Hashable."""

    batch: int
    q_len: int
    kv_len: int
    kv_heads: int
    group: int
    head_dim: int
    v_head_dim: int
    dtype: str
    block_q: int
    block_kv: int
    scale: float
    causal: bool
    window: tuple[int | None, int | None] | None
    softcap: float | None
    #: Attention dropout's rate; the keep bits of each tile are drawn from the
    #: call's key and the tile's positions (:func:`tile_keep`).
    dropout_rate: float = 0.0

    @classmethod
    def of(cls, call: AttentionCall, blocks: BlockConfig) -> Plan:
        return cls(
            batch=call.batch,
            q_len=call.q_len,
            kv_len=call.kv_len,
            kv_heads=call.kv_heads,
            group=call.group,
            head_dim=call.head_dim,
            v_head_dim=call.v_head_dim,
            dtype=call.dtype,
            block_q=blocks.block_q,
            block_kv=blocks.block_kv,
            scale=call.scale,
            causal=call.causal,
            window=call.window,
            softcap=call.softcap,
            dropout_rate=call.dropout_rate,
        )

    @property
    def acc(self) -> Any:
        """Softmax and accumulation dtype: float32, float64 for a float64 call (x64)."""
        return jnp.float64 if self.dtype == "float64" else jnp.float32

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def n_kv(self) -> int:
        return -(-self.kv_len // self.block_kv)

    @property
    def rows(self) -> int:
        """Rows of one query tile: the whole GQA group times ``block_q``."""
        return self.group * self.block_q

    @property
    def offset(self) -> int:
        return self.kv_len - self.q_len

    @property
    def left(self) -> int | None:
        return None if self.window is None else self.window[0]

    @property
    def right(self) -> int | None:
        return None if self.window is None else self.window[1]


class Masks(NamedTuple):
    """Non-differentiable visibility operands in block-friendly layouts.

    q_seg ``[n_q, B, rows]``, kv_seg ``[n_kv, B, block_kv]``, q_len and
    kv_len ``[B]`` int32 clipped to the sequence, mask
    ``[B|1, Hkv|1, group|1, Tq_pad, Tk_pad]`` bool. None where absent.
    """

    q_seg: Array = None
    kv_seg: Array = None
    q_len: Array = None
    kv_len: Array = None
    mask: Array = None


def pad_axis(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def q_to_blocks(plan: Plan, x: Array) -> Array:
    """``[B, Tq, Hq, E]`` -> ``[n_q, B, Hkv, rows, E]`` (zero-padded)."""
    b, bq, e = plan.batch, plan.block_q, x.shape[-1]
    x = pad_axis(x, 1, plan.n_q * bq)
    x = x.reshape(b, plan.n_q, bq, plan.kv_heads, plan.group, e)
    x = x.transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(plan.n_q, b, plan.kv_heads, plan.rows, e)


def q_from_blocks(plan: Plan, x: Array) -> Array:
    """Inverse of :func:`q_to_blocks`, dropping the padding."""
    b, bq, e = plan.batch, plan.block_q, x.shape[-1]
    x = x.reshape(plan.n_q, b, plan.kv_heads, plan.group, bq, e)
    x = x.transpose(1, 0, 4, 2, 3, 5)
    x = x.reshape(b, plan.n_q * bq, plan.kv_heads * plan.group, e)
    return x[:, : plan.q_len]


def q_block(plan: Plan, x: Array, qi: Array) -> Array:
    """Query block ``qi`` of a padded ``[B, Tq_pad, Hq, E]`` array as the
    rows of one tile, ``[B, Hkv, rows, E]``."""
    b, bq, e = plan.batch, plan.block_q, x.shape[-1]
    x = lax.dynamic_slice_in_dim(x, qi * bq, bq, axis=1)
    x = x.reshape(b, bq, plan.kv_heads, plan.group, e).transpose(0, 2, 3, 1, 4)
    return x.reshape(b, plan.kv_heads, plan.rows, e)


def kv_block(plan: Plan, x: Array, kj: Array) -> Array:
    """Key block ``kj`` of a padded ``[B, Tk_pad, Hkv, E]`` array as one tile,
    ``[B, Hkv, block_kv, E]``."""
    x = lax.dynamic_slice_in_dim(x, kj * plan.block_kv, plan.block_kv, axis=1)
    return x.transpose(0, 2, 1, 3)


def put_q_block(plan: Plan, x: Array, tile: Array, qi: Array) -> Array:
    """Write a ``[B, Hkv, rows, E]`` tile into query block ``qi`` of a padded
    ``[B, Tq_pad, Hq, E]`` array (inverse of :func:`q_block`)."""
    b, bq, e = plan.batch, plan.block_q, tile.shape[-1]
    tile = tile.reshape(b, plan.kv_heads, plan.group, bq, e).transpose(0, 3, 1, 2, 4)
    tile = tile.reshape(b, bq, plan.kv_heads * plan.group, e)
    return lax.dynamic_update_slice_in_dim(x, tile.astype(x.dtype), qi * bq, axis=1)


def put_row_block(plan: Plan, x: Array, tile: Array, qi: Array) -> Array:
    """Write per-row values ``[B, Hkv, rows]`` into query block ``qi`` of a
    padded ``[B, Hq, Tq_pad]`` array."""
    tile = tile.reshape(plan.batch, plan.kv_heads * plan.group, plan.block_q)
    return lax.dynamic_update_slice_in_dim(x, tile, qi * plan.block_q, axis=2)


def rows_to_blocks(plan: Plan, x: Array) -> Array:
    """Per-row values ``[B, Hq, Tq]`` -> ``[n_q, B, Hkv, rows]``."""
    return q_to_blocks(plan, x.transpose(0, 2, 1)[..., None])[..., 0]


def kv_to_blocks(plan: Plan, x: Array) -> Array:
    """``[B, Tk, Hkv, E]`` -> ``[n_kv, B, Hkv, block_kv, E]`` (zero-padded)."""
    b, bk, e = plan.batch, plan.block_kv, x.shape[-1]
    x = pad_axis(x, 1, plan.n_kv * bk)
    x = x.reshape(b, plan.n_kv, bk, plan.kv_heads, e)
    return x.transpose(1, 0, 3, 2, 4)


def kv_from_blocks(plan: Plan, x: Array) -> Array:
    """Inverse of :func:`kv_to_blocks`, dropping the padding."""
    b, e = plan.batch, x.shape[-1]
    x = x.transpose(1, 0, 3, 2, 4).reshape(b, plan.n_kv * plan.block_kv, plan.kv_heads, e)
    return x[:, : plan.kv_len]


def pairwise_to_padded(plan: Plan, x: Array, value: Any) -> Array:
    """Mask or bias ``[B|1, Hq|1, Tq, Tk]`` -> ``[B|1, Hkv|1, G|1, Tq_pad, Tk_pad]``."""
    heads = x.shape[1]
    split = (plan.kv_heads, plan.group) if heads > 1 else (1, 1)
    x = x.reshape(x.shape[0], *split, plan.q_len, plan.kv_len)
    x = pad_axis(x, 3, plan.n_q * plan.block_q, value)
    return pad_axis(x, 4, plan.n_kv * plan.block_kv, value)


def pairwise_from_padded(plan: Plan, x: Array) -> Array:
    """Inverse of :func:`pairwise_to_padded`: ``[B|1, Hq|1, Tq, Tk]``."""
    heads = x.shape[1] * x.shape[2]
    return x.reshape(x.shape[0], heads, *x.shape[3:])[..., : plan.q_len, : plan.kv_len]


def pairwise_block(plan: Plan, x: Array, qi: Array, kj: Array) -> Array:
    """The ``(qi, kj)`` tile of a padded pairwise array: ``[B|1, Hkv|1, rows, block_kv]``."""
    bq, bk = plan.block_q, plan.block_kv
    zero = jnp.int32(0)  # one index type with the int32 block indices, x64 or not
    tile = lax.dynamic_slice(
        x, (zero, zero, zero, qi * bq, kj * bk), (x.shape[0], x.shape[1], x.shape[2], bq, bk)
    )
    tile = jnp.broadcast_to(tile, (*tile.shape[:2], plan.group, bq, bk))
    return tile.reshape(tile.shape[0], tile.shape[1], plan.rows, bk)


def prepare_masks(plan: Plan, operands: Operands) -> Masks:
    """Put the call's visibility operands in block layouts."""
    q_seg = kv_seg = q_len = kv_len = mask = None
    if operands.q_segment_ids is not None:
        ids = pad_axis(operands.q_segment_ids.astype(jnp.int32), 1, plan.n_q * plan.block_q)
        ids = ids.reshape(plan.batch, plan.n_q, plan.block_q).transpose(1, 0, 2)
        q_seg = jnp.tile(ids, (1, 1, plan.group))
        ids = pad_axis(operands.kv_segment_ids.astype(jnp.int32), 1, plan.n_kv * plan.block_kv)
        kv_seg = ids.reshape(plan.batch, plan.n_kv, plan.block_kv).transpose(1, 0, 2)
    if operands.q_lengths is not None:
        q_len = jnp.clip(operands.q_lengths.astype(jnp.int32), 0, plan.q_len)
    if operands.kv_lengths is not None:
        kv_len = jnp.clip(operands.kv_lengths.astype(jnp.int32), 0, plan.kv_len)
    if operands.mask is not None:
        mask = pairwise_to_padded(plan, operands.mask, False)
    return Masks(q_seg, kv_seg, q_len, kv_len, mask)


def tile_keep(plan: Plan, seed: Array, qi: Array, kj: Array) -> Array:
    """Dropout's keep bits of tile ``(qi, kj)``: bool ``[B, Hkv, rows, block_kv]``.

    Drawn from ``seed`` and the tile's positions alone (authoring's
    counter-based rule), so the backward pass, whatever its blocks, draws
    again exactly the bits the forward used, and no mask of the whole
    sequence is ever stored.
    """
    from attn_backends.authoring import dropout_keep_at

    row = jnp.arange(plan.rows, dtype=jnp.int32)
    g, t = row // plan.block_q, row % plan.block_q
    b = jnp.arange(plan.batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(plan.kv_heads, dtype=jnp.int32)[None, :, None, None] * plan.group
    h = h + g[None, None, :, None]
    i = (qi * plan.block_q + t)[None, None, :, None]
    j = kj * plan.block_kv + jnp.arange(plan.block_kv, dtype=jnp.int32)[None, None, None, :]
    return dropout_keep_at(seed, b, h, i, j, rate=plan.dropout_rate,
                           q_heads=plan.kv_heads * plan.group, q_len=plan.q_len)


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


def visibility(plan: Plan, masks: Masks, qi: Array, kj: Array, positional: bool) -> Array | None:
    """Which keys of tile ``(qi, kj)`` each row sees, broadcastable to
    ``[B, Hkv, rows, block_kv]``; None when every key is visible.

    ``positional=False`` leaves out causal, window, kv padding and kv_lengths:
    the caller has proven the tile is entirely inside them.
    """
    q_pos = qi * plan.block_q + jnp.arange(plan.rows, dtype=jnp.int32)[:, None] % plan.block_q
    k_pos = kj * plan.block_kv + jnp.arange(plan.block_kv, dtype=jnp.int32)[None, :]
    vis = None
    if positional:
        diag = q_pos + plan.offset
        if plan.causal:
            vis = _and(vis, k_pos <= diag)
        if plan.left is not None:
            vis = _and(vis, k_pos >= diag - plan.left)
        if plan.right is not None:
            vis = _and(vis, k_pos <= diag + plan.right)
        if plan.kv_len % plan.block_kv:
            vis = _and(vis, k_pos < plan.kv_len)
        if masks.kv_len is not None:
            vis = _and(vis, k_pos < masks.kv_len[:, None, None, None])
    if masks.q_len is not None:
        vis = _and(vis, q_pos < masks.q_len[:, None, None, None])
    if masks.q_seg is not None:
        q_ids = lax.dynamic_index_in_dim(masks.q_seg, qi, keepdims=False)
        kv_ids = lax.dynamic_index_in_dim(masks.kv_seg, kj, keepdims=False)
        vis = _and(vis, q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    if masks.mask is not None:
        vis = _and(vis, pairwise_block(plan, masks.mask, qi, kj))
    return vis
