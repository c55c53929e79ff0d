"""Paged attention, the obvious way: gather each sequence's pages into dense keys
and values, mask, dense softmax. The cache is in the canonical layout."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import paged_rows

_HIGHEST = jax.lax.Precision.HIGHEST


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns: zeros."""
    rows = q.shape[0]
    if rows == 0 or batch.kv_lens.shape[0] == 0:
        return jnp.zeros_like(q)
    k_pages, v_pages = cache.arrays
    wide = jnp.dtype(call.accumulation_dtype)
    seqs, pages = batch.page_table.shape
    length = pages * call.page_size
    # Table entries past a sequence's last page may be garbage: clip them to a
    # real page, whose positions are masked below anyway.
    table = jnp.clip(batch.page_table, 0, cache.num_pages - 1)
    pos = jnp.arange(length)
    # [S, L, Hkv, D]: sequence s's position p, zeroed past kv_lens and for
    # uncounted sequences (whose kv_lens may be garbage), so garbage (NaN, Inf)
    # there never meets a zero weight (0 * NaN is NaN).
    counted = jnp.arange(seqs) < batch.num_seqs
    filled = ((pos[None, :] < batch.kv_lens[:, None]) & counted[:, None])[:, :, None, None]
    keys, values = (
        jnp.where(filled, x[table].reshape(seqs, length, call.kv_heads, call.head_dim), 0)
        for x in (k_pages, v_pages))
    seq, owned, row_pos = paged_rows(batch, rows)
    visible = (pos[None, :] <= row_pos[:, None]) & owned[:, None]
    if call.window is not None:
        visible &= pos[None, :] >= row_pos[:, None] - call.window[0]
    qg = jnp.where(owned[:, None, None], q, 0).astype(wide)
    qg = qg.reshape(rows, call.kv_heads, call.group, call.head_dim)
    logits = jnp.einsum("tkgd,tlkd->tkgl", qg, keys[seq].astype(wide),
                        precision=_HIGHEST) * call.scale
    if call.softcap is not None:
        logits = call.softcap * jnp.tanh(logits / call.softcap)
    mask = visible[:, None, None, :]
    peak = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0)), 0)
    total = weights.sum(-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, values[seq].astype(wide), precision=_HIGHEST)
    return out.reshape(rows, call.q_heads, call.head_dim).astype(q.dtype)
