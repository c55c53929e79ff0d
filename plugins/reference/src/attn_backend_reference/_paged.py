"""Paged attention, the obvious way: gather each sequence's pages into dense keys
and values, mask, dense softmax. The cache is in the canonical layout."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import paged_dense

_HIGHEST = jax.lax.Precision.HIGHEST


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns: zeros."""
    rows = q.shape[0]
    if rows == 0 or batch.kv_lens.shape[0] == 0:
        return jnp.zeros_like(q)
    wide = jnp.dtype(call.accumulation_dtype)
    k_pages, v_pages, *scales = cache.arrays
    keys, values, seq, owned, visible = paged_dense(call, k_pages, v_pages, batch, rows, scales)
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
