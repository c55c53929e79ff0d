"""Static plan and layouts of the decode path (a few query rows, a long cache).

Layout: the logits of one call are ``[B, T, Hkv, G, Tq]``: keys in the
cache's own order on the outer axes, and the GQA group ``G`` and query
positions ``Tq`` as the innermost axes, so one pass over each key row of K
(``[B, T, Hkv, D]``, read in place, never transposed) serves every query
head that reads it. Split into chunks that is ``[B, n, C, Hkv, G, Tq]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from attn_backends import AttentionCall, Operands
from jax import lax

Array = Any

# Keys per chunk: enough that the per-chunk statistics are a small part of
# the work. Not tuned by a benchmark script; a one-off timing of the output
# product at T=2048 on cpu (BENCHMARKS.md, "Decode") found chunks of 64
# slower than 256 and 512 no faster.
DECODE_CHUNK = 256
# The cache prefix a call reads is picked at run time among at most this
# many static lengths (halving from Tk), from the largest kv_lengths.
_PREFIXES = 6


@dataclass(frozen=True)
class DecodePlan:
    """Everything static about one decode call. Hashable."""

    batch: int
    q_len: int
    kv_len: int
    kv_heads: int
    group: int
    head_dim: int
    v_head_dim: int
    dtype: str
    chunk: int
    scale: float
    causal: bool
    window: tuple[int | None, int | None] | None
    softcap: float | None

    @classmethod
    def of(cls, call: AttentionCall, chunk: int = DECODE_CHUNK) -> DecodePlan:
        return cls(
            batch=call.batch,
            q_len=call.q_len,
            kv_len=call.kv_len,
            kv_heads=call.kv_heads,
            group=call.group,
            head_dim=call.head_dim,
            v_head_dim=call.v_head_dim,
            dtype=call.dtype,
            chunk=max(1, min(chunk, call.kv_len)),
            scale=call.scale,
            causal=call.causal,
            window=call.window,
            softcap=call.softcap,
        )

    @property
    def acc(self) -> Any:
        """Softmax and accumulation dtype: float32, float64 for a float64 call (x64)."""
        return jnp.float64 if self.dtype == "float64" else jnp.float32

    @property
    def offset(self) -> int:
        return self.kv_len - self.q_len

    def prefixes(self, has_kv_lengths: bool) -> tuple[int, ...]:
        """Cache prefixes (ascending, the last is Tk) one of which each call
        reads: the shortest that holds every key below the largest
        kv_lengths. Whole chunks, so a prefix never ends in a partial one."""
        if not has_kv_lengths:
            return (self.kv_len,)
        sizes = {self.kv_len}
        chunks = self.kv_len // self.chunk
        for halvings in range(1, _PREFIXES):
            part = -(-chunks // (1 << halvings))
            if part * self.chunk < self.kv_len:
                sizes.add(part * self.chunk)
        return tuple(sorted(sizes))

    def segments(self, length: int) -> tuple[tuple[int, int, int], ...]:
        """``(start, n_chunks, chunk)`` pieces covering keys ``[0, length)``:
        whole chunks, then one short chunk for the rest."""
        whole = length // self.chunk
        pieces = []
        if whole:
            pieces.append((0, whole, self.chunk))
        if length % self.chunk:
            pieces.append((whole * self.chunk, 1, length % self.chunk))
        return tuple(pieces)


def widen(x: Array) -> Array:
    """float32 copy of a narrow tile (float64 stays float64), elementwise, so XLA fuses it into the
    tile's consumer: no widened copy of the cache is made. (Widening
    bfloat16 by shifting its bits, which vectorises in isolation, ran 4x
    slower inside the fused product on cpu than a plain convert.)"""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def q_rows(plan: DecodePlan, q: Array) -> Array:
    """``[B, Tq, Hq, D]`` -> ``[B, Hkv, G, Tq, D]``."""
    b, t, _, d = q.shape
    return q.reshape(b, t, plan.kv_heads, plan.group, d).transpose(0, 2, 3, 1, 4)


def q_unrows(x: Array) -> Array:
    """``[B, Hkv, G, Tq, E]`` -> ``[B, Tq, Hq, E]`` (inverse of :func:`q_rows`)."""
    b, h, g, t, e = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, h * g, e)


def pairwise_in(plan: DecodePlan, x: Array) -> Array:
    """Mask or bias ``[B|1, Hq|1, Tq, Tk]`` -> ``[B|1, Tk, Hkv|1, G|1, Tq]``."""
    split = (plan.kv_heads, plan.group) if x.shape[1] > 1 else (1, 1)
    x = x.reshape(x.shape[0], *split, plan.q_len, plan.kv_len)
    return x.transpose(0, 4, 1, 2, 3)


def chunked(x: Array, start: int, n: int, chunk: int) -> Array:
    """Keys ``[start, start + n * chunk)`` of a ``[B, T, ...]`` array as
    ``[B, n, chunk, ...]`` (a slice and reshape that XLA fuses into the
    consumer: the cache is not copied)."""
    x = lax.slice_in_dim(x, start, start + n * chunk, axis=1)
    return x.reshape(x.shape[0], n, chunk, *x.shape[2:])


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


def visible(plan: DecodePlan, ops: Operands, start: int, n: int, chunk: int) -> Array | None:
    """Which keys of chunks ``[start, start + n * chunk)`` each row sees,
    broadcastable to ``[B, n, chunk, Hkv, G, Tq]``; None if all are.

    ``ops.mask``, if given, is already in :func:`pairwise_in` layout.
    """
    key = start + jnp.arange(n * chunk, dtype=jnp.int32).reshape(1, n, chunk, 1, 1, 1)
    row = jnp.arange(plan.q_len, dtype=jnp.int32).reshape(1, 1, 1, 1, 1, -1)
    diag = row + plan.offset
    vis = None
    if plan.causal:
        vis = _and(vis, key <= diag)
    if plan.window is not None and plan.window[0] is not None:
        vis = _and(vis, key >= diag - plan.window[0])
    if plan.window is not None and plan.window[1] is not None:
        vis = _and(vis, key <= diag + plan.window[1])
    if ops.kv_lengths is not None:
        vis = _and(vis, key < ops.kv_lengths.astype(jnp.int32).reshape(-1, 1, 1, 1, 1, 1))
    if ops.q_lengths is not None:
        vis = _and(vis, row < ops.q_lengths.astype(jnp.int32).reshape(-1, 1, 1, 1, 1, 1))
    if ops.q_segment_ids is not None:
        q_ids = ops.q_segment_ids.astype(jnp.int32)[:, None, None, None, None, :]
        kv_ids = chunked(ops.kv_segment_ids.astype(jnp.int32), start, n, chunk)
        vis = _and(vis, q_ids == kv_ids[..., None, None, None])
    if ops.mask is not None:
        vis = _and(vis, chunked(ops.mask, start, n, chunk))
    return vis
