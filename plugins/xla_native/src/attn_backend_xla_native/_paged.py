"""Paged attention, blockwise over pages: an online softmax over blocks of
``pages_per_block`` pages, each tile of query rows reading its own sequence's
pages through the page table, one block at a time.

Rows are grouped into tiles of ``rows_per_tile`` consecutive rows of one
sequence (a sequence's last tile may be partial), so a prefill chunk gathers
each block of its pages once per tile, not once per row, and its logits are
matmuls of ``rows_per_tile * group`` rows per kv head. A batch of decode steps
only (every counted sequence has at most one row) runs tiles of one row
instead (a ``cond`` at run time), so no tile computes padding rows.

Each iteration gathers one block of pages per tile, ``[tiles,
pages_per_block * page_size, Hkv, D]``: temporary memory follows the rows, the
sequences and the block, never the pool (``num_pages``) nor the table's width.
The loop runs from the first block any counted row sees to the last (a
``while_loop`` with bounds read from the batch at run time), so a step of short
sequences reads few blocks whatever the table's width; a row outside its own
range in an iteration is masked.

Garbage (NaN, Inf) in pages no row may see, past ``kv_lens``, behind table
entries past a sequence's last page, or in padding rows is selected away
(``where``), never multiplied by a zero weight.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import paged_rows
from jax import lax

from ._config import PagedConfig


class _Tiles(NamedTuple):
    """Tiles of query rows: tile i holds rows ``row[i]`` of sequence ``seq[i]``.

    ``seq`` int32 ``[n]``; ``row``, ``pos`` (each row's key position) int32 and
    ``owned`` bool ``[n, rows_per_tile]``; ``of_row``, ``slot_of_row`` int32
    ``[T]``: where each query row's output sits; ``row_owned`` bool ``[T]``.
    """

    seq: Any
    row: Any
    owned: Any
    pos: Any
    of_row: Any
    slot_of_row: Any
    row_owned: Any


def _tiles(batch: PagedBatch, rows: int, size: int) -> _Tiles:
    """The batch's rows cut into tiles of ``size`` rows, none across sequences."""
    cu, kv_lens = batch.cu_q_lens, batch.kv_lens
    seqs = kv_lens.shape[0]
    # Entries past num_seqs may be anything: such sequences get no tile.
    counted = jnp.arange(seqs) < batch.num_seqs
    q_lens = jnp.where(counted, jnp.maximum(cu[1:] - cu[:-1], 0), 0)
    ends = jnp.cumsum(-(-q_lens // size))
    starts = ends - -(-q_lens // size)
    # Each sequence's tiles hold its rows with at most one partial tile.
    count = min(rows, -(-rows // size) + seqs)
    tile = jnp.arange(count)
    seq = jnp.clip(jnp.searchsorted(ends, tile, side="right"), 0, seqs - 1)
    row = (cu[seq] + (tile - starts[seq]) * size)[:, None] + jnp.arange(size)
    owned = (tile < ends[-1])[:, None] & (row < cu[seq + 1][:, None])
    pos = (kv_lens[seq] - q_lens[seq] - cu[seq])[:, None] + row
    row_seq, row_owned, _ = paged_rows(batch, rows)
    within = jnp.arange(rows) - cu[row_seq]
    of_row = jnp.clip(starts[row_seq] + within // size, 0, count - 1)
    return _Tiles(seq, jnp.clip(row, 0, rows - 1), owned, pos, of_row, within % size, row_owned)


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    config: PagedConfig) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns: zeros."""
    rows = q.shape[0]
    if rows == 0 or batch.kv_lens.shape[0] == 0:
        return jnp.zeros_like(q)
    size = min(config.rows_per_tile, rows)
    if size == 1 or call.max_q_len == 1:
        return _attend(call, q, cache, batch, config, 1)
    counted = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs
    longest = jnp.max(jnp.where(counted, batch.cu_q_lens[1:] - batch.cu_q_lens[:-1], 0))
    return lax.cond(longest <= 1, lambda: _attend(call, q, cache, batch, config, 1),
                    lambda: _attend(call, q, cache, batch, config, size))


def _attend(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch, config: PagedConfig,
            size: int) -> Any:
    """:func:`paged_attention` over tiles of ``size`` rows."""
    rows = q.shape[0]
    k_pages, v_pages = cache.arrays
    wide = jnp.dtype(call.accumulation_dtype)
    width = batch.page_table.shape[1]
    # More pages per block than the table has columns would only read clipped
    # columns again.
    per_block = min(config.pages_per_block, width)
    block_keys = per_block * call.page_size
    tiles = _tiles(batch, rows, size)
    count = tiles.seq.shape[0]
    kv_len = batch.kv_lens[tiles.seq]
    live = tiles.owned.any(-1)
    first = jnp.zeros_like(tiles.pos) if call.window is None else tiles.pos - call.window[0]
    first = jnp.maximum(first, 0)
    # Blocks [lo, hi) hold every key a counted row sees; none if no row is owned.
    lo = jnp.min(jnp.where(tiles.owned, first // block_keys, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(tiles.owned, tiles.pos // block_keys + 1, 0))
    qg = jnp.where(tiles.owned[..., None, None], q[tiles.row], 0).astype(wide)
    qg = qg.reshape(count, size, call.kv_heads, call.group, call.head_dim)
    offsets = jnp.arange(block_keys)
    shape = (count, call.kv_heads, size, call.group)

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
        keys, values = (
            jnp.where(filled[:, :, None, None],
                      x[pages].reshape(count, block_keys, call.kv_heads, call.head_dim), 0)
            for x in (k_pages, v_pages))
        logits = jnp.einsum("nqkgd,nlkd->nkqgl", qg, keys.astype(wide),
                            precision=lax.Precision.HIGHEST) * call.scale
        if call.softcap is not None:
            logits = call.softcap * jnp.tanh(logits / call.softcap)
        mask = visible[:, None, :, None, :]
        logits = jnp.where(mask, logits, -jnp.inf)
        new_peak = jnp.maximum(peak, logits.max(-1))
        # A row that has seen nothing yet keeps peak -inf: shift by 0 instead,
        # so exp(-inf - -inf) never makes a NaN.
        shift = jnp.where(jnp.isfinite(new_peak), new_peak, 0)
        weights = jnp.where(mask, jnp.exp(logits - shift[..., None]), 0)
        rescale = jnp.exp(peak - shift)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "nkqgl,nlkd->nkqgd", weights, values.astype(wide), precision=lax.Precision.HIGHEST)
        return b + 1, new_peak, total, acc

    state = (lo, jnp.full(shape, -jnp.inf, wide), jnp.zeros(shape, wide),
             jnp.zeros((*shape, call.head_dim), wide))
    _, _, total, acc = lax.while_loop(lambda s: s[0] < hi, body, state)
    out = acc / jnp.where(total > 0, total, 1)[..., None]
    out = out.transpose(0, 2, 1, 3, 4).reshape(count, size, call.q_heads, call.head_dim)
    out = jnp.where(tiles.row_owned[:, None, None], out[tiles.of_row, tiles.slot_of_row], 0)
    return out.astype(q.dtype)
