"""Decode-only paged calls (``max_q_len == 1``, bfloat16) through JAX's TPU
paged attention kernel, ``jax.experimental.pallas.ops.tpu.paged_attention``, on
core's ``heads_first`` cache layout (``attn_backends.authoring.heads_first``: K
and V each ``[Hkv, num_pages, page_size, D]``, the kernel's own), which it reads
as it lies.

Why this path for decode steps (a design reason, not a TPU measurement): the
kernel walks one kv head's pages once for all the query heads of its group, one
query row per sequence, and stops at each sequence's length. Unlike the ragged
kernel it runs in Pallas' TPU interpret mode, so it is certified on CPU.

What the kernel does that the adapter has to answer for (read from its source,
the same ``paged_attention_kernel.py`` in jax 0.10.2 and 0.12.0.1):

- **rows**: one query row per kernel "sequence", with a length and a row of
  page indices. Each query row t of the batch becomes one: it sees keys
  ``0 .. pos_t`` of the sequence owning it (:func:`~attn_backends.authoring.
  paged_rows`), so length ``pos_t + 1`` (``kv_lens[s]`` for a decode row), its
  table row the owner's. Padding rows (past ``cu_q_lens[num_seqs]``) get length
  0, which the kernel answers with zeros (it zeroes every row's output before
  its first block) without reading their q or a key.
- **max_q_len**: a batch with a sequence of more rows than ``max_q_len=1``
  breaks the call's promise; core (``PagedAttention.__call__``) rejects it when
  the batch is concrete and turns those sequences' rows to NaN when it is
  traced. (Each such row would still be causal here: length ``pos_t + 1``.)
- **bfloat16 only**: it rounds K and V to bfloat16 when it loads them
  (``_maybe_dequantize``), so a float32 cache would lose about three digits:
  float32 calls go to the ragged path. It keeps the running output in q's dtype
  and re-normalises it after every block, so q is passed in **float32** (the
  accumulator and softmax statistics are then float32) and the output is
  rounded to bfloat16 once, at the end.
- **no scale**: q is multiplied by ``scale`` (in float32) before the kernel, so
  softcap applies to ``scale * q·k`` as the contract says. No window: the
  kernel always starts at key 0 (window calls go to the ragged path).
- **blocks**: it reads ``pages_per_compute_block`` pages a step, which must
  divide the table's width: the table is widened to a multiple of it
  (:class:`~attn_backend_flash_pallas.RaggedBlockSizes`'
  ``kv_pages_per_block``, clipped to the table's width).
- **table entries**: every entry it reads must name a page of the pool (its
  DMA reads whatever it names): entries are clipped into the pool, and those
  past a row's last page (read by its last block) name the row's last page.
- **masking is additive**: keys past the length in the last block get
  ``q·k + mask_value`` (``-0.7 * float32 max``) and their values are multiplied
  by the resulting 0. So NaN or Inf in a slot past ``kv_lens`` of a sequence's
  last page (which the kernel reads whole), or a key whose logit nears float32's
  range, would reach the result. The adapter checks those slots (the last page
  of each row: ``[Hkv, T, page_size, D]``, never the pool) and, when any is
  non-finite or its logit is beyond ``1e30``, runs the kernel instead on a copy
  of the rows' pages with every slot past the length zeroed (``lax.cond``:
  only that branch pays for the copy). A finite slot masked as above adds
  exactly zero, so both branches give the zero-filled run's result bitwise.
- **no backward**: core refuses gradients for every paged call.

In interpret mode (the plugin's switch on) a call selected for cpu runs the
kernel in Pallas' TPU interpreter (``force_tpu_interpret_mode``: the kernel takes
no ``interpret`` argument); a call selected for tpu gets the Mosaic kernel.
Not ``lax.platform_dependent``: its lowering for tpu alone fails on the
interpreter's ordered callbacks in the cpu branch.
"""

from __future__ import annotations

from typing import Any

from attn_backends import KVCache, PagedBatch, PagedCall
from attn_backends.authoring import paged_rows

from ._interpret import SWITCH

#: A masked logit at most this large adds exactly zero: ``x + mask_value`` is
#: then below ``-2e38``, whose exp underflows against any real row maximum.
LOGIT_BOUND = 1e30


def declines(call: PagedCall) -> list[str]:
    """Why this decode path does not serve ``call`` (empty: it does)."""
    reasons = []
    if call.max_q_len != 1:
        reasons.append(f"max_q_len={call.max_q_len}: JAX's paged_attention takes one query "
                       "row per sequence (max_q_len=1)")
    if call.dtype != "bfloat16":
        reasons.append(f"dtype {call.dtype}: JAX's paged_attention rounds K and V to bfloat16")
    if call.window is not None:
        reasons.append("window: JAX's paged_attention always starts at key 0")
    return reasons


def _kernel(call: PagedCall, q: Any, k: Any, v: Any, lengths: Any, table: Any,
            block: int) -> Any:
    """JAX's kernel (imported when first traced): q ``[T, Hq, D]`` float32, k and v
    ``[Hkv, pages, page_size, D]``, lengths ``[T]``, table ``[T, P']``; in Pallas' TPU
    interpreter when the call is for cpu and the switch is on."""
    import contextlib

    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    emulated = call.platform == "cpu" and SWITCH.enabled()
    with pltpu.force_tpu_interpret_mode() if emulated else contextlib.nullcontext():
        return paged_attention(q, k, v, lengths, table, pages_per_compute_block=block,
                               attn_logits_soft_cap=call.softcap)


def _row_pages(call: PagedCall, cache: KVCache, batch: PagedBatch, rows: int,
               block: int) -> tuple[Any, Any]:
    """Per query row: length ``[T]`` (0: no sequence owns it) and table ``[T, P']``
    (P' the table's width rounded up to ``block``; every entry in the pool, those
    past the row's last page naming that page)."""
    import jax.numpy as jnp

    seq, owned, pos = paged_rows(batch, rows)
    width = batch.page_table.shape[1]
    lengths = jnp.where(owned, jnp.clip(pos + 1, 0, width * call.page_size), 0)
    lengths = lengths.astype(jnp.int32)
    cols = -(-width // block) * block
    last = jnp.maximum((lengths + call.page_size - 1) // call.page_size - 1, 0)
    col = jnp.minimum(jnp.arange(cols)[None, :], last[:, None])
    table = jnp.clip(batch.page_table[seq[:, None], col], 0, cache.num_pages - 1)
    return lengths, table.astype(jnp.int32)


def _tail_is_garbage(call: PagedCall, cache: KVCache, q: Any, lengths: Any,
                     table: Any) -> Any:
    """Whether any slot past a row's length in its last page could reach the
    kernel's result (non-finite K or V, or a logit beyond :data:`LOGIT_BOUND`).
    Reads each row's last page only: ``[Hkv, T, page_size, D]``."""
    import jax.numpy as jnp

    ps = call.page_size
    last = table[jnp.arange(table.shape[0]), jnp.maximum((lengths + ps - 1) // ps - 1, 0)]
    offsets = jnp.arange(ps)[None, :]
    # Past the length within the last page; a row of length 0 reads nothing.
    filled = lengths - (jnp.maximum(lengths, 1) - 1) // ps * ps  # slots used in the last page
    tail = (offsets >= filled[:, None]) & (lengths[:, None] > 0)
    k, v = (x[:, last].astype(jnp.float32) for x in cache.arrays)  # [Hkv, T, ps, D]
    qg = q.reshape(q.shape[0], call.kv_heads, call.group, call.head_dim)
    logits = jnp.einsum("thgd,htpd->thgp", qg, k)
    # NaN fails the comparison too.
    bad_logit = (~(jnp.abs(logits) <= LOGIT_BOUND)).any(axis=(1, 2))  # [T, ps]
    bad_v = (~jnp.isfinite(v)).any(axis=(0, 3))  # [T, ps]
    return ((bad_logit | bad_v) & tail).any()


def _sanitised_copy(call: PagedCall, cache: KVCache, lengths: Any,
                    table: Any) -> tuple[Any, Any, Any]:
    """K and V ``[Hkv, T * P', page_size, D]``: each row's pages in table order with
    every slot at or past its length zeroed; and the identity table ``[T, P']``."""
    import jax.numpy as jnp

    rows, cols = table.shape
    position = (jnp.arange(cols)[:, None] * call.page_size + jnp.arange(call.page_size))
    live = (position[None] < lengths[:, None, None]).reshape(rows * cols, call.page_size)
    pages = table.reshape(-1)
    k, v = (jnp.where(live[None, :, :, None], x[:, pages], jnp.zeros((), x.dtype))
            for x in cache.arrays)
    identity = jnp.arange(rows * cols, dtype=jnp.int32).reshape(rows, cols)
    return k, v, identity


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    kv_pages_per_block: int) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns
    have length 0: zeros."""
    import jax
    import jax.numpy as jnp

    rows, width = q.shape[0], batch.page_table.shape[1]
    if rows == 0 or batch.page_table.shape[0] == 0:
        return jnp.zeros_like(q)
    block = min(kv_pages_per_block, width)
    lengths, table = _row_pages(call, cache, batch, rows, block)
    q32 = q.astype(jnp.float32) * jnp.float32(call.scale)

    def in_place(q32: Any, lengths: Any, table: Any) -> Any:
        k, v = cache.arrays
        return _kernel(call, q32, k, v, lengths, table, block)

    def on_a_copy(q32: Any, lengths: Any, table: Any) -> Any:
        k, v, identity = _sanitised_copy(call, cache, lengths, table)
        return _kernel(call, q32, k, v, lengths, identity, block)

    garbage = _tail_is_garbage(call, cache, q32, lengths, table)
    return jax.lax.cond(garbage, on_a_copy, in_place, q32, lengths, table).astype(q.dtype)
