"""Paged calls served by tokamax's XLA implementations, as an adapter: tokamax has
no paged attention that fits the paged contract (its ``xla_chunked`` takes a
``paging_info`` with one query batch per page list, no causal mask and no mixed
prefill rows, and its public API does not expose it), so each call gathers the
sequences' pages into dense keys and values (``attn_backends.authoring.
paged_dense``, as reference does) and runs one dense call of tokamax's through
the dense adapter (``_adapter.run``: its mask mapping and its zeros for rows
that see no key).

Each sequence slot of the table is one batch row of the dense call: its keys
and values (``L = P * page_size`` positions) and its query rows at slots
``0 .. R-1`` (``R``: ``max_q_len``, or the batch's row count when it is None),
under a mask of the positions each row sees (causal from the row's position,
the window; nothing for a slot that holds no row). The cost, on each call: the
gather copies every sequence's whole table width of pages (``S * L`` positions
of K and V; tokamax's ``xla`` then repeats them to the query heads), and the
logits are ``[S, Hq, R, L]``: without ``max_q_len``, every sequence's logits
span every row of the batch. The cache is in the canonical layout.
"""

from __future__ import annotations

from typing import Any

from attn_backends.authoring import (
    AttentionCall,
    KVCache,
    Operands,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
    paged_dense,
)

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
    check_vma=True,
    jax_versions=">=0.10,<0.13",
)


def dense_call(call: PagedCall, seqs: int, rows: int, length: int) -> AttentionCall:
    """The dense call a paged call becomes: one batch row per sequence slot of the
    table (``seqs``), ``rows`` query rows each, ``length`` key positions, under a
    mask ``[seqs, 1, rows, length]``."""
    return AttentionCall(
        batch=seqs, q_len=rows, kv_len=length, q_heads=call.q_heads, kv_heads=call.kv_heads,
        head_dim=call.head_dim, v_head_dim=call.head_dim, dtype=call.dtype, scale=call.scale,
        softcap=call.softcap, mask_shape=(seqs, 1, rows, length), platform=call.platform)


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
        owns: zeros."""
        import jax.numpy as jnp

        rows = q.shape[0]
        if rows == 0 or batch.kv_lens.shape[0] == 0:
            return jnp.zeros_like(q)
        keys, values, seq, owned, visible = paged_dense(call, *cache.arrays, batch, rows)
        seqs, length = keys.shape[:2]
        # Each sequence's rows at its slots 0..R-1 (R: the most rows a sequence
        # may have); a padding row, or a row past max_q_len (whose sequence core
        # flags with NaN), is dropped, so its q (garbage) never enters the call.
        most = rows if call.max_q_len is None else min(rows, call.max_q_len)
        j = jnp.arange(rows) - batch.cu_q_lens[seq]
        slot = jnp.where(owned & (j < most), seq * most + j, seqs * most)
        q_seqs, mask = (
            jnp.zeros((seqs * most, *x.shape[1:]), x.dtype).at[slot].set(x, mode="drop")
            .reshape(seqs, most, *x.shape[1:]) for x in (q, visible))
        # Slots holding no row see no key: the dense adapter gives them zeros.
        out = self.attend(dense_call(call, seqs, most, length), q_seqs,  # type: ignore[attr-defined]
                          keys, values, Operands(mask=mask[:, None]), options)
        out = out.reshape(seqs * most, call.q_heads, call.head_dim)
        return jnp.where(owned[:, None, None], out[jnp.minimum(slot, seqs * most - 1)], 0)
