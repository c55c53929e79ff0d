"""Paged calls served by tokamax's XLA implementations, as an adapter: tokamax has
no paged attention that fits the paged contract (its ``xla_chunked`` takes a
``paging_info`` with one query batch per page list, no causal mask and no mixed
prefill rows, and its public API does not expose it), so each call gathers the
sequences' pages into dense keys and values (``attn_backends.authoring.
paged_dense``, as reference does) and runs one dense call of tokamax's through
the dense adapter (``_adapter.run``: its mask mapping and its zeros for rows
that see no key).

Each query row is one batch row of the dense call (Tq = 1): its sequence's keys
and values (``L = P * page_size`` positions, copied per row) and a key mask of
the positions it sees (causal from the row's position, the window, nothing for
a padding row). The cost, on each call: the gather copies every sequence's whole
table width of pages, then each row's sequence again ``[T, L, Hkv, D]``, and
the logits are ``[T, Hq, L]``. The cache is in the canonical layout.
"""

from __future__ import annotations

from typing import Any

from attn_backends import (
    AttentionCall,
    KVCache,
    Operands,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
)
from attn_backends.authoring import paged_dense

from ._environment import tokamax_reasons

#: What the paged path serves: what the dense XLA manifest serves that a paged
#: call can use (any head dim and page size, GQA/MQA, softcap, window; float32,
#: bfloat16, float16, no float64), confirmed by the suite's paged family.
PAGED_MANIFEST = PagedCapabilities(
    platforms=frozenset({"cpu", "gpu", "tpu"}),
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    gqa=True,
    softcap=True,
    window=True,
    jax_versions=">=0.10,<0.13",
)


def dense_call(call: PagedCall, rows: int, length: int) -> AttentionCall:
    """The dense call one paged call of ``rows`` query rows over ``length`` key
    positions per sequence becomes: one batch row per query row, one query, a
    key mask ``[rows, 1, 1, length]``."""
    return AttentionCall(
        batch=rows, q_len=1, kv_len=length, q_heads=call.q_heads, kv_heads=call.kv_heads,
        head_dim=call.head_dim, v_head_dim=call.head_dim, dtype=call.dtype, scale=call.scale,
        softcap=call.softcap, mask_shape=(rows, 1, 1, length), platform=call.platform)


class TokamaxPaged(PagedBackend):
    """Paged support for a :class:`~._plugin.TokamaxBackend` whose implementation
    runs any dense call its manifest claims (mixed in before it); ``options``
    are the dense backend's (for ``tokamax_xla_chunked``, a ``ChunkSizes``)."""

    paged_capabilities = PAGED_MANIFEST

    def check_paged(self, call: PagedCall) -> list[str]:
        return list(tokamax_reasons())

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` in q's dtype; rows no sequence
        owns: zeros (the dense adapter's zeros for a row that sees no key)."""
        import jax.numpy as jnp

        rows = q.shape[0]
        if rows == 0 or batch.kv_lens.shape[0] == 0:
            return jnp.zeros_like(q)
        keys, values, seq, _, visible = paged_dense(call, *cache.arrays, batch, rows)
        dense = dense_call(call, rows, keys.shape[1])
        out = self.attend(dense, q[:, None], keys[seq], values[seq],  # type: ignore[attr-defined]
                          Operands(mask=visible[:, None, None, :]), options)
        return out[:, 0]
