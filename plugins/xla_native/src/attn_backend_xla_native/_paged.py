"""Paged attention, blockwise over pages: an online softmax over blocks of
``pages_per_block`` pages, each query row reading its own sequence's pages
through the page table, one block at a time.

Each iteration gathers one block of pages per query row, ``[T, pages_per_block
* page_size, Hkv, D]``: temporary memory follows the rows and the block, never
the pool (``num_pages``) nor the table's width. The loop runs from the first
block any counted row sees to the last (a ``while_loop`` with bounds read from
the batch at run time), so a step of short sequences reads few blocks whatever
the table's width; a row outside its own range in an iteration is masked.

Garbage (NaN, Inf) in pages no row may see, past ``kv_lens``, behind table
entries past a sequence's last page, or in padding rows is selected away
(``where``), never multiplied by a zero weight.

Rows of one prefill chunk each gather the same pages: simple, and right for
decode steps (one row per sequence); a chunked prefill pays its rows' reads.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import paged_rows
from jax import lax

from ._config import PagedConfig


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    config: PagedConfig) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns: zeros."""
    rows = q.shape[0]
    if rows == 0 or batch.kv_lens.shape[0] == 0:
        return jnp.zeros_like(q)
    k_pages, v_pages = cache.arrays
    wide = jnp.dtype(call.accumulation_dtype)
    width = batch.page_table.shape[1]
    # More pages per block than the table has columns would only read clipped
    # columns again.
    per_block = min(config.pages_per_block, width)
    block_keys = per_block * call.page_size
    seq, owned, row_pos = paged_rows(batch, rows)
    kv_len = batch.kv_lens[seq]
    first = jnp.zeros_like(row_pos) if call.window is None else row_pos - call.window[0]
    first = jnp.maximum(first, 0)
    # Blocks [lo, hi) hold every key a counted row sees; none if no row is owned.
    lo = jnp.min(jnp.where(owned, first // block_keys, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(owned, row_pos // block_keys + 1, 0))
    qg = jnp.where(owned[:, None, None], q, 0).astype(wide)
    qg = qg.reshape(rows, call.kv_heads, call.group, call.head_dim)
    offsets = jnp.arange(block_keys)
    shape = (rows, call.kv_heads, call.group)

    def body(state: tuple[Any, ...]) -> tuple[Any, ...]:
        b, peak, total, acc = state
        # Table columns past the table's width are clipped: their positions are
        # >= width * page_size >= kv_len, masked below. Entries past a sequence's
        # last page may be garbage: clipped to a real page, masked likewise.
        cols = jnp.minimum(b * per_block + jnp.arange(per_block), width - 1)
        pages = jnp.clip(batch.page_table[seq[:, None], cols[None, :]], 0, cache.num_pages - 1)
        pos = b * block_keys + offsets
        filled = (pos[None, :] < kv_len[:, None]) & owned[:, None]
        visible = filled & (pos[None, :] <= row_pos[:, None])
        visible &= pos[None, :] >= first[:, None]
        keys, values = (
            jnp.where(filled[:, :, None, None],
                      x[pages].reshape(rows, block_keys, call.kv_heads, call.head_dim), 0)
            for x in (k_pages, v_pages))
        logits = jnp.einsum("tkgd,tlkd->tkgl", qg, keys.astype(wide),
                            precision=lax.Precision.HIGHEST) * call.scale
        if call.softcap is not None:
            logits = call.softcap * jnp.tanh(logits / call.softcap)
        mask = visible[:, None, None, :]
        logits = jnp.where(mask, logits, -jnp.inf)
        new_peak = jnp.maximum(peak, logits.max(-1))
        # A row that has seen nothing yet keeps peak -inf: shift by 0 instead,
        # so exp(-inf - -inf) never makes a NaN.
        shift = jnp.where(jnp.isfinite(new_peak), new_peak, 0)
        weights = jnp.where(mask, jnp.exp(logits - shift[..., None]), 0)
        rescale = jnp.exp(peak - shift)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "tkgl,tlkd->tkgd", weights, values.astype(wide), precision=lax.Precision.HIGHEST)
        return b + 1, new_peak, total, acc

    state = (lo, jnp.full(shape, -jnp.inf, wide), jnp.zeros(shape, wide),
             jnp.zeros((*shape, call.head_dim), wide))
    _, _, total, acc = lax.while_loop(lambda s: s[0] < hi, body, state)
    out = acc / jnp.where(total > 0, total, 1)[..., None]
    return out.reshape(rows, call.q_heads, call.head_dim).astype(q.dtype)

