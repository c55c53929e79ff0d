"""Paged attention, blockwise over pages: an online softmax over blocks of
``pages_per_block`` pages, each tile of query rows reading its own sequence's
pages through the page table, one block at a time.

Tiles come in two kinds, cut from the batch at run time. A decode step (a
sequence with one row) is a tile of one row; the rows of a prefill chunk (a
sequence with more) go in tiles of ``rows_per_tile`` consecutive rows of that
sequence (its last tile may be partial), so a chunk gathers each block of its
pages once per tile, not once per row, and its logits are matmuls of
``rows_per_tile * group`` rows per kv head. No decode step pays for a chunk's
padding rows. A call made with ``max_q_len=1`` compiles the decode kind only.

Each kind runs as a loop over groups of ``tiles_per_group`` tiles, only as
many groups as the batch has tiles of that kind (a ``while_loop`` with a bound
read at run time); within a group, a loop over the blocks that group's own
rows see, from the first to the last. Chunk tiles run in order (a chunk's
tiles side by side); decode tiles run sorted by key length, so a group holds
steps of like lengths and a short step does not run to the longest
sequence's last block. A row outside its own range in a group's iteration is
masked.

The cache is ``heads_first`` (K and V each ``[Hkv, num_pages, page_size, D]``,
core's layout): each kv head's pages are one pool, so a block of one head's
keys is whole runs of ``page_size * D`` values and both products are batched
over (kv head, tile) with nothing transposed. In the canonical layout (heads
inside each position) the same kernel read a third of the bandwidth
(BENCHMARKS.md, "Paged attention").

Each iteration gathers one block of pages per tile of the group,
``[Hkv, tiles_per_group, pages_per_block * page_size, D]``: temporary memory
follows the rows, the sequences, the group and the block, never the pool
(``num_pages``) nor the table's width.

A quantized cache (``call.kv_dtype``) adds K's and V's scales ``[Hkv,
num_pages, page_size]``: each block's values are multiplied by their
positions' scales as the block is read, in the accumulation dtype.

Garbage (NaN, Inf) in pages no row may see, past ``kv_lens``, behind table
entries past a sequence's last page, or in padding rows is selected away
(``where``), never multiplied by a zero weight; a padding row's output is never
written (its scatter index is out of range and dropped), so it stays zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import dequantize, vary_like
from jax import lax

from ._config import PagedConfig


class _Tiles(NamedTuple):
    """Tiles of one kind in the order they run: tile i holds ``rows[i]`` rows of
    sequence ``seq[i]`` from query row ``start[i]`` (each int32 ``[n]``); the
    first ``count`` (int32 ``[]``) tiles are live, the rest hold nothing."""

    seq: Any
    start: Any
    rows: Any
    count: Any


class _Group(NamedTuple):
    """One group's tiles: ``seq`` int32 ``[G]``; ``row`` (query row, clipped),
    ``pos`` (its key position) int32 and ``owned`` bool ``[G, size]``."""

    seq: Any
    row: Any
    owned: Any
    pos: Any


def _q_lens(batch: PagedBatch) -> Any:
    """Rows of each sequence, int32 ``[S]``; 0 for entries past ``num_seqs``
    (which may hold anything)."""
    counted = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs
    return jnp.where(counted, jnp.maximum(batch.cu_q_lens[1:] - batch.cu_q_lens[:-1], 0), 0)


def _chunk_tiles(batch: PagedBatch, q_lens: Any, size: int, n: int) -> _Tiles:
    """Sequences of more than one row cut into tiles of ``size`` rows, in order."""
    per_seq = jnp.where(q_lens > 1, -(-q_lens // size), 0)
    ends = jnp.cumsum(per_seq)
    tile = jnp.arange(n)
    seq = jnp.clip(jnp.searchsorted(ends, tile, side="right"), 0, q_lens.shape[0] - 1)
    start = batch.cu_q_lens[seq] + (tile - (ends - per_seq)[seq]) * size
    return _Tiles(seq, start, jnp.clip(batch.cu_q_lens[seq + 1] - start, 0, size), ends[-1])


def _decode_tiles(batch: PagedBatch, q_lens: Any) -> _Tiles:
    """One tile per sequence of one row, longest keys first."""
    decode = q_lens == 1
    # Stable sort: non-decode sequences (key -1) go last, past ``count``.
    seq = jnp.argsort(-jnp.where(decode, batch.kv_lens, -1), stable=True).astype(jnp.int32)
    return _Tiles(seq, batch.cu_q_lens[seq], jnp.ones_like(seq), jnp.sum(decode))


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    config: PagedConfig) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns: zeros."""
    rows, seqs = q.shape[0], batch.kv_lens.shape[0]
    out = vary_like(jnp.zeros_like(q), q, *cache.arrays)
    if rows == 0 or seqs == 0:
        return out
    q_lens = _q_lens(batch)
    out = _run(call, q, cache, batch, config, q_lens, _decode_tiles(batch, q_lens), 1, out)
    if call.max_q_len == 1 or rows == 1:
        return out
    size = min(config.rows_per_tile, rows)
    # A sequence of q_len rows (q_len >= 2) has ceil(q_len / size) tiles, at most
    # q_len / size + 1: with q_lens summing to at most T, at most ceil(T / size)
    # + min(S, T // 2) tiles.
    n = min(rows, -(-rows // size) + min(seqs, rows // 2))
    chunks = _chunk_tiles(batch, q_lens, size, n)
    return _run(call, q, cache, batch, config, q_lens, chunks, size, out)


def _run(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch, config: PagedConfig,
         q_lens: Any, tiles: _Tiles, size: int, out: Any) -> Any:
    """``out`` with the rows of ``tiles`` (tiles of ``size`` rows) written, group
    by group; ``q_lens`` int32 ``[S]`` from :func:`_q_lens`."""
    rows, n = q.shape[0], tiles.seq.shape[0]
    width = min(config.tiles_per_group, n)

    def one_group(g: Any, out: Any) -> Any:
        index = g * width + jnp.arange(width)
        tile = jnp.minimum(index, n - 1)
        seq = tiles.seq[tile]
        row = tiles.start[tile][:, None] + jnp.arange(size)
        owned = (index < tiles.count)[:, None] & (jnp.arange(size) < tiles.rows[tile][:, None])
        row = jnp.clip(row, 0, rows - 1)
        pos = (batch.kv_lens[seq] - q_lens[seq] - batch.cu_q_lens[seq])[:, None] + row
        part = _attend(call, q, cache, batch, config, _Group(seq, row, owned, pos))
        # Each owned row sits in exactly one tile; unowned slots go out of range.
        return out.at[jnp.where(owned, row, rows)].set(part.astype(q.dtype), mode="drop")

    return lax.fori_loop(0, -(-tiles.count // width), one_group, out)


def _attend(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch, config: PagedConfig,
            tiles: _Group) -> Any:
    """One group of tiles ``[G, size]`` -> its rows' outputs ``[G, size, Hq, D]``
    (the accumulation dtype; unowned rows: anything finite).

    Works heads first, as the cache lies: per kv head and tile, the ``size *
    group`` query rows of the tile's rows and the head's query heads, against a
    block of keys ``[Hkv, G, block_keys, D]`` gathered from the head's own pool,
    so both products are batched over ``(Hkv, G)`` with nothing transposed.
    """
    k_pages, v_pages, *scales = cache.arrays
    wide = jnp.dtype(call.accumulation_dtype)
    width = batch.page_table.shape[1]
    # More pages per block than the table has columns would only read clipped
    # columns again.
    per_block = min(config.pages_per_block, width)
    block_keys = per_block * call.page_size
    count, size = tiles.row.shape
    heads, group, dim = call.kv_heads, call.group, call.head_dim
    kv_len = batch.kv_lens[tiles.seq]
    live = tiles.owned.any(-1)
    first = jnp.zeros_like(tiles.pos) if call.window is None else tiles.pos - call.window[0]
    first = jnp.maximum(first, 0)
    # Blocks [lo, hi) hold every key the group's rows see; none if no row is owned.
    lo = jnp.min(jnp.where(tiles.owned, first // block_keys, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(tiles.owned, tiles.pos // block_keys + 1, 0))
    # [G, size, Hq, D] -> [Hkv, G, size * group, D]: row r of a tile is (row, query head).
    qg = jnp.where(tiles.owned[..., None, None], q[tiles.row], 0).astype(wide)
    qg = qg.reshape(count, size, heads, group, dim).transpose(2, 0, 1, 3, 4)
    qg = qg.reshape(heads, count, size * group, dim)
    offsets = jnp.arange(block_keys)
    shape = (heads, count, size * group)

    def body(state: tuple[Any, ...]) -> tuple[Any, ...]:
        b, peak, total, acc = state
        # Table columns past the table's width are clipped: their positions are
        # >= width * page_size >= kv_len, masked below. Entries past a sequence's
        # last page may be garbage: clipped to a real page, masked likewise.
        cols = jnp.minimum(b * per_block + jnp.arange(per_block), width - 1)
        pages = jnp.clip(batch.page_table[tiles.seq[:, None], cols[None, :]], 0,
                         cache.num_pages - 1)
        pos = b * block_keys + offsets
        filled = (pos[None, :] < kv_len[:, None]) & live[:, None]
        visible = filled[:, None, :] & tiles.owned[..., None]
        visible &= pos <= tiles.pos[..., None]
        visible &= pos >= first[..., None]
        keys, values = (x[:, pages].reshape(heads, count, block_keys, dim)
                        for x in (k_pages, v_pages))
        if scales:
            # A quantized cache: this block's values times their positions' scales
            # ([Hkv, num_pages, page_size] each), never the whole pool at once.
            keys, values = (dequantize(x, s[:, pages].reshape(heads, count, block_keys), wide)
                            for x, s in zip((keys, values), scales, strict=True))
        keys, values = (jnp.where(filled[None, :, :, None], x, 0) for x in (keys, values))
        logits = jnp.einsum("hnrd,hnld->hnrl", qg, keys.astype(wide),
                            precision=lax.Precision.HIGHEST) * call.scale
        if call.softcap is not None:
            logits = call.softcap * jnp.tanh(logits / call.softcap)
        # [G, size, L] -> [1, G, size * group, L], row (row, query head) as in qg.
        mask = jnp.broadcast_to(visible[:, :, None, :], (count, size, group, block_keys))
        mask = mask.reshape(1, count, size * group, block_keys)
        logits = jnp.where(mask, logits, -jnp.inf)
        new_peak = jnp.maximum(peak, logits.max(-1))
        # A row that has seen nothing yet keeps peak -inf: shift by 0 instead,
        # so exp(-inf - -inf) never makes a NaN.
        shift = jnp.where(jnp.isfinite(new_peak), new_peak, 0)
        weights = jnp.where(mask, jnp.exp(logits - shift[..., None]), 0)
        rescale = jnp.exp(peak - shift)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "hnrl,hnld->hnrd", weights, values.astype(wide), precision=lax.Precision.HIGHEST)
        return b + 1, new_peak, total, acc

    # Inside a user's shard_map the accumulators vary as q and the cache do.
    state = (lo, *vary_like((jnp.full(shape, -jnp.inf, wide), jnp.zeros(shape, wide),
                             jnp.zeros((*shape, dim), wide)), qg, k_pages, v_pages))
    _, _, total, acc = lax.while_loop(lambda s: s[0] < hi, body, state)
    out = acc / jnp.where(total > 0, total, 1)[..., None]
    out = out.reshape(heads, count, size, group, dim).transpose(1, 2, 0, 3, 4)
    return out.reshape(count, size, call.q_heads, dim)
