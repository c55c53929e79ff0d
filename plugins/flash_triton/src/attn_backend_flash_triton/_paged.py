"""flash_triton's paged attention: JAX's Pallas GPU paged-attention kernel over a
heads-first cache, every query row its own kernel sequence.

Imported lazily (from ``attend_paged``): importing it imports the kernel module.

**The kernel** (``jax.experimental.pallas.ops.gpu.paged_attention``; the same
source in jax 0.10.2 and 0.12, which deprecates the module and warns at its
import, silenced here as for the dense kernel):

- K and V pages each ``[Hkv, num_pages, page_size, D]`` (heads first); q
  ``[B, Hq, D]``, *one query row per sequence*; ``block_tables`` int32 ``[B,
  pages_per_sequence]``; ``lengths`` int32 ``[B]``: sequence b attends to its
  keys ``0 .. lengths[b]-1``. There is no causal mask within a sequence, no
  window start and no scale (logits are the raw ``q . k``; a softcap
  ``cap * tanh(x / cap)`` is applied to them).
- GQA: q's heads become ``[Hkv, G]`` and G is padded to ``block_h`` (a multiple
  of 16: Triton's dot needs 16 rows), so G < 16 computes 16 / G times the
  useful work, though it reads K and V once per kv head.
- Per sequence (the public wrapper vmaps) the grid is ``(Hkv, cdiv(G, block_h),
  k_splits)``: each program walks its partition of ``pages_per_sequence /
  k_splits`` table entries in compute blocks of ``pages_per_compute_block``
  pages (keys per block a power of two >= 16), up to the block holding the last
  page of ``lengths[b]`` (a partition past it is skipped by a ``cond``, so
  length 0 gives o = 0, l = 0); ``pages_per_sequence`` must divide by
  ``k_splits`` and each partition by ``pages_per_compute_block`` (asserted);
  the whole pool is one block (a pointer in Triton; in interpret mode each
  program slices it, so tests keep pools small).
  Accumulation float32 (the softmax weights are cast to V's dtype before their
  dot); float32 dots run at JAX's default precision on a GPU (TF32 on Ampere
  and later), IEEE float32 in interpret mode.
- Keys past ``lengths`` are hidden by a ``where`` on the logits only (to
  ``-0.7 * float32 max``, not -inf), so their V is multiplied by an exact zero
  weight: NaN or Inf there (which the contract allows) would make the output
  NaN (``0 * NaN``); and the last compute block reads whole pages past the
  sequence's last one through the table.
- The public wrapper merges the partitions (``o / (l + eps)``, o kept in q's
  dtype in between) and returns the normalised output only: no logsumexp.

**The mapping** (what this module adds):

- The cache layout is the kernel's own, core's ``heads_first``
  (``attn_backends.authoring.heads_first``): K and V each ``[Hkv, num_pages,
  page_size, D]``; ``write`` scatters straight into it; nothing transposes or
  copies the pool per call.
- Ragged batches (prefill chunks too): every query row is its own kernel
  sequence, whose keys are positions ``0 .. pos`` (``pos`` the row's position)
  through its sequence's table row: exact for causal attention, and the
  kernel's decode shape. The cost: a chunk of n rows reads its sequence's K and
  V n times (once per row) where a prefill kernel would read them once per
  block of rows, so prefill chunks are served correctly but memory-bound;
  decode steps cost what the kernel costs.
- Garbage never meets a weight: each row's kernel range is cut to whole compute
  blocks ``[c0, c1)`` (``c1`` its end rounded down to a block, ``c0`` the
  window start rounded up to one; the row's table is shifted by ``c0``), where
  every key is a real one; its keys outside (fewer than a block at the end,
  and with a window fewer than a block at the start) are gathered here, one
  compute block each, zeroed by ``where`` before any product, and attended in
  float32 (temporary ``[rows, Hkv, keys per block, D]`` per edge: small for
  decode steps, a block per row for a prefill chunk). This needs the
  partitions' (o, l, m), which the public wrapper does not return, so this
  module runs JAX's ``paged_attention_kernel`` under its own ``pallas_call``
  (the same grid and blocks as the wrapper; o kept in float32, where the
  wrapper stores it in q's dtype) and merges the partitions and edge blocks
  itself (online-softmax merge). Table entries the rows do not
  use are clipped into the pool; padding rows get length 0 and output zeros.
- ``scale`` is folded into q (in float32, then q's dtype) before the kernel.
"""

from __future__ import annotations

import functools
from typing import Any

from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import jax_api, paged_rows

from ._config import TritonPagedBlocks

#: The kernel's pallas_call name (in the Triton custom call's config on gpu).
KERNEL_NAME = "flash_triton_paged"


def kernel_module() -> Any:
    """``jax.experimental.pallas.ops.gpu.paged_attention`` (jax < 0.12: see ``check_paged``)."""
    return jax_api.pallas_triton_ops("paged_attention")


def _kernel_partials(call: PagedCall, blocks: TritonPagedBlocks, splits: int,
                     interpret: bool) -> Any:
    """``f(q, k_pages, v_pages, table, length) -> (o, l, m)`` for one row: q ``[Hq,
    D]``, table ``[P']`` (``P'`` a multiple of ``splits * pages_per_compute_block``),
    length ``[1]`` a multiple of a compute block; o ``[splits, Hkv, G, D]`` float32
    (unnormalised), l and m ``[splits, Hkv, G]``, per partition of the table."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    module = kernel_module()
    g, d, bh = call.group, call.head_dim, blocks.block_h
    padded = -(-g // bh) * bh
    kernel = functools.partial(
        module.paged_attention_kernel, num_heads=g,
        pages_per_compute_block=blocks.pages_per_compute_block,
        mask_value=module.DEFAULT_MASK_VALUE, attn_logits_soft_cap=call.softcap)

    def run(q: Any, k_pages: Any, v_pages: Any, table: Any, length: Any,
            interpret: bool) -> Any:
        hkv, num_pages, page_size, _ = k_pages.shape
        per_split = table.shape[0] // splits
        pool = pl.BlockSpec((None, num_pages, page_size, d), lambda h, i, k: (h, 0, 0, 0))
        stat = pl.BlockSpec((None, None, bh), lambda h, i, k: (k, h, i))
        qg = jnp.pad(q.reshape(hkv, g, d), ((0, 0), (0, padded - g), (0, 0)))
        o, total, peak = pl.pallas_call(
            kernel,
            grid=(hkv, padded // bh, splits),
            in_specs=[pl.BlockSpec((None, bh, d), lambda h, i, k: (h, i, 0)), pool, None,
                      pool, None, pl.BlockSpec((None, per_split), lambda h, i, k: (k, 0)),
                      pl.BlockSpec((1,), lambda h, i, k: (0,))],
            out_specs=[pl.BlockSpec((None, None, bh, d), lambda h, i, k: (k, h, i, 0)),
                       stat, stat],
            out_shape=[jax.ShapeDtypeStruct((splits, hkv, padded, d), jnp.float32),
                       *[jax.ShapeDtypeStruct((splits, hkv, padded), jnp.float32)] * 2],
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                                 num_stages=blocks.num_stages),
            name=KERNEL_NAME,
        )(qg, k_pages, None, v_pages, None, table.reshape(splits, per_split), length)
        return o[:, :, :g], total[:, :, :g], peak[:, :, :g]

    def rows(interpret: bool) -> Any:
        return jax.vmap(functools.partial(run, interpret=interpret), (0, None, None, 0, 0))

    if not interpret:
        return rows(False)
    # lax.platform_dependent picks at lowering: the emulator never reaches a GPU
    # program (nor a jax.export for cuda).
    return lambda *a: jax.lax.platform_dependent(*a, cpu=rows(True), default=rows(False))


def _edge(call: PagedCall, q: Any, cache: KVCache, table: Any, start: Any, keep: Any,
          keys: int) -> tuple[Any, Any, Any]:
    """Attention of q ``[R, Hkv, G, D]`` (float32) over the compute block at
    positions ``start + [0, keys)`` of each row, restricted to ``keep`` (bool
    ``[R, keys]``); returns o ``[R, Hkv, G, D]`` (unnormalised), l and m ``[R, Hkv, G]``."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    per_block = keys // call.page_size
    cols = jnp.clip(start[:, None] // call.page_size + jnp.arange(per_block), 0,
                    table.shape[1] - 1)
    pages = jnp.clip(jnp.take_along_axis(table, cols, axis=1), 0, cache.num_pages - 1)
    mask = keep[None, :, :, None]
    # [Hkv, R, keys, D], zeroed where not kept: slots past kv_lens and pages
    # outside the sequence may hold NaN or Inf, and 0 * NaN is NaN.
    k, v = (jnp.where(mask, jnp.take(x, pages, axis=1).reshape(
        call.kv_heads, -1, keys, call.head_dim), 0).astype(f32) for x in cache.arrays)
    logits = jnp.einsum("rkgd,krld->rkgl", q, k, precision=jax.lax.Precision.HIGHEST)
    if call.softcap is not None:
        logits = call.softcap * jnp.tanh(logits / call.softcap)
    seen = keep[:, None, None, :]
    # The kernel's convention for a row that sees nothing: m = float32 min, l = 0.
    m = jnp.max(jnp.where(seen, logits, jnp.finfo(f32).min), axis=-1)
    p = jnp.where(seen, jnp.exp(logits - m[..., None]), 0)
    o = jnp.einsum("rkgl,krld->rkgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o, p.sum(-1), m


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    blocks: TritonPagedBlocks, interpret: bool) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no counted sequence
    owns output zeros. ``interpret``: run the kernel emulated when lowered for cpu."""
    import jax.numpy as jnp

    rows, (seqs, width) = q.shape[0], batch.page_table.shape
    if rows == 0 or seqs == 0 or width == 0:  # no row sees a key
        return jnp.zeros_like(q)
    f32 = jnp.float32
    hkv, g, d = call.kv_heads, call.group, call.head_dim
    keys = blocks.block_keys(call.page_size)
    per_block = blocks.pages_per_compute_block
    table_blocks = -(-width // per_block)
    splits = min(blocks.k_splits, table_blocks)
    # The kernel's table width: a whole number of compute blocks per partition.
    kernel_width = -(-table_blocks // splits) * splits * per_block

    seq, owned, pos = paged_rows(batch, rows)
    end = jnp.where(owned, pos + 1, 0)  # keys [lo, end) of each row
    lo = jnp.zeros_like(end) if call.window is None else jnp.maximum(end - 1 - call.window[0], 0)
    first = -(-lo // keys) * keys  # c0: the kernel's first key
    last = jnp.maximum(end // keys * keys, first)  # c1: one past its last
    table = batch.page_table[seq]  # [R, P]: each row reads its sequence's pages
    cols = first[:, None] // call.page_size + jnp.arange(kernel_width)
    used = cols < last[:, None] // call.page_size
    kernel_table = jnp.where(
        used, jnp.take_along_axis(table, jnp.clip(cols, 0, width - 1), axis=1), 0)
    kernel_table = jnp.clip(kernel_table, 0, cache.num_pages - 1)

    scaled = (q.astype(f32) * call.scale).astype(q.dtype)
    partials = _kernel_partials(call, blocks, splits, interpret)(
        scaled, *cache.arrays, kernel_table.astype(jnp.int32),
        (last - first)[:, None].astype(jnp.int32))
    parts = [tuple(x[:, s] for x in partials) for s in range(splits)]

    qf = scaled.astype(f32).reshape(rows, hkv, g, d)
    span = jnp.arange(keys)
    tail = end // keys * keys  # the block holding the row's last key (when not whole)
    at = tail[:, None] + span
    parts.append(_edge(call, qf, cache, table, tail, (at >= first[:, None]) & (at < end[:, None]),
                       keys))
    if call.window is not None:
        head = first - keys  # the block holding the window's first key (when cut)
        at = head[:, None] + span
        parts.append(_edge(call, qf, cache, table, head,
                           (at >= lo[:, None]) & (at < jnp.minimum(first, end)[:, None]), keys))

    peak = jnp.max(jnp.stack([p[2] for p in parts]), axis=0)
    acc = sum(p[0] * jnp.exp(p[2] - peak)[..., None] for p in parts)
    total = sum(p[1] * jnp.exp(p[2] - peak) for p in parts)
    # Every owned row sees its own key, so total > 0 there; padding rows: zeros.
    out = jnp.where((owned[:, None, None, None]) & (total[..., None] > 0),
                    acc / jnp.where(total > 0, total, 1)[..., None], 0)
    return out.reshape(rows, call.q_heads, d).astype(q.dtype)
