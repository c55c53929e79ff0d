"""Paged calls (docs/DESIGN.md, "Paged attention") through JAX's ragged paged
attention kernel, ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``:
prefill chunks and decode steps of many sequences in one ragged batch.

The cache is kept in the kernel's own layout, :data:`LAYOUT` (``"kv_combined"``):
one array ``[num_pages, page_size, 2 * Hkv, D]`` with kv head h's key at index
``2h`` and its value at ``2h + 1`` of the third axis, so the kernel reads it as
it lies (no transpose or copy of the cache outside the kernel) and ``write``
scatters the new tokens' rows into it, touching only their slots.

What the kernel does that the adapter has to answer for (read from its source,
the same ``kernel.py`` in jax 0.10.2 and 0.12.0.1):

- **layout and shapes**: K and V interleaved per head as above; ``num_seqs``
  must be ``[1]``; kv lengths, page table and ``cu_q_lens`` int32, shaped by the
  table's rows. ``head_dim`` must be a multiple of 128 (its online softmax
  broadcasts a ``[rows, 128]`` scratch over ``head_dim`` lanes; JAX's own tests
  and tuned table cover 128 only, so only 128 is claimed). ``2 * Hkv`` must tile
  the TPU's sublanes for the dtype (``get_min_heads_per_blk`` raises otherwise:
  :func:`heads_reasons` asks it).
- **blocks**: a grid over blocks of ``num_queries_per_block`` query rows, each
  walking its sequences' keys ``num_kv_pages_per_block`` pages at a time
  (``<=`` the table's width). Without them it looks them up in a table per TPU
  generation, which raises off a TPU, so an export from a host without one
  passes them (:class:`RaggedBlockSizes`). JAX tunes bfloat16, D=128 and page
  sizes 16 to 256: the page sizes claimed.
- **scale, softcap, window**: logits are ``q·k * sm_scale`` then
  ``soft_cap * tanh(logits / soft_cap)``, as the contract says. Its
  ``sliding_window=w`` hides keys at ``pos <= row - w``; the contract's
  ``window=(left, None)`` keeps ``pos >= row - left``, so ``w = left + 1``. Causal
  is bottom-right per sequence (row j at ``kv_len - q_len + j``), as the contract.
- **masking**: causal and window add ``mask_value`` (``-0.7 * float32 max``) to
  the logits; keys past ``kv_len`` in a block are selected to zero (``where``)
  before the matmuls, so NaN there never reaches a result; table entries past a
  sequence's last page are never read (it reads column 0 instead); pages no
  counted table row references are never read.
- **dtypes**: q and the cache in the call's dtype (float32 or bfloat16); logits,
  softmax statistics and the output accumulator in float32; the output is cast
  to q's dtype once, at the end.
- **padding rows**: rows past ``cu_q_lens[num_seqs]`` are never stored: their
  output is whatever the accumulator scratch held (stale rows of an earlier
  block, or uninitialised memory). Padding rows' q (NaN included) only meets
  its own row's logits, which are never stored.
- **uncounted sequences**: the kernel stops at ``num_seqs``, except its first
  prefetch, which fetches sequence 0's first block whatever ``num_seqs`` is:
  with ``num_seqs=0`` it reads garbage ``kv_lens[0]`` and table entries.
- **sequences with no keys**: it prefetches each next sequence's first block
  while computing the current one and waits for it when it gets there; a
  sequence with ``kv_len == 0`` runs no block, so it neither waits for its own
  prefetch nor starts the next, and the sequence after it would read the wrong
  pages.
- **no backward**: core refuses gradients for every paged call.

So the adapter (:func:`paged_attention`) clips the page table into the pool,
gives uncounted sequences ``kv_len`` 0 and counted ones at least 1 (a counted
sequence with no keys has no rows either, since ``q_len <= kv_len``, so its one
key is seen by no one), and selects padding rows' output to zero. None of those
touch the cache: they are ``[S]``, ``[S, P]`` and ``[T, Hq, D]`` arrays.

Neither of JAX's Pallas interpreters runs this kernel on CPU (jax 0.10.2 and
0.12.0.1): TPU interpret mode cannot read through the kernel's reshaped VMEM ref
(``'ReshapeTransform' object has no attribute 'indices'``) and the HLO
interpreter fails on its masked stores into an indexed scratch ref
(``'TypedInt' object has no attribute 'shape'``). So with the interpret switch
on, a cpu call this kernel would serve is refused with those errors; only the
decode path (``_paged_decode.py``) serves cpu.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn_backends import KVCache, PagedBatch, PagedCall

#: The cache layout's name: K and V of a page interleaved per kv head.
LAYOUT = "kv_combined"


@dataclasses.dataclass(frozen=True)
class RaggedBlockSizes:
    """Blocks of the paged kernels (pass as the backend's paged ``options``).

    ``kv_pages_per_block``: pages of keys per step of a sequence (clipped to the
    table's width; the decode kernel's ``pages_per_compute_block``);
    ``queries_per_block``: query rows per grid step of the ragged kernel (clipped
    to q's rows). The defaults, 32 and 32, are the kernel's own untuned defaults for
    TPU v4, its smallest; not tuned on hardware in this project. Without options
    on a TPU host the kernel's tuned table for that chip is used instead.
    """

    kv_pages_per_block: int = 32
    queries_per_block: int = 32

    def __post_init__(self) -> None:
        for name in ("kv_pages_per_block", "queries_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RaggedBlockSizes: {name} must be an int >= 1, got {value!r}")


def heads_reasons(call: PagedCall) -> list[str]:
    """Why the kernel cannot tile ``call``'s heads (empty: it can), by its own rule."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    dtype = jnp.dtype(call.dtype)
    try:
        kernel.get_min_heads_per_blk(call.q_heads, 2 * call.kv_heads, dtype, dtype)
    except ValueError as exc:
        return [f"num_kv_heads={call.kv_heads}: the kernel cannot tile 2 * num_kv_heads "
                f"in {call.dtype} ({exc})"]
    return []


def from_canonical(call: PagedCall, k_pages: Any, v_pages: Any) -> KVCache:
    """K and V ``[num_pages, page_size, Hkv, D]`` -> one ``[num_pages, page_size,
    2 * Hkv, D]`` array, K of head h at ``2h``, V at ``2h + 1`` (exact)."""
    import jax.numpy as jnp

    num_pages = k_pages.shape[0]
    kv = jnp.stack([k_pages, v_pages], axis=3).reshape(
        num_pages, call.page_size, 2 * call.kv_heads, call.head_dim)
    return KVCache((kv,), LAYOUT, call.page_size, num_pages)


def to_canonical(call: PagedCall, cache: KVCache) -> tuple[Any, Any]:
    """The cache's K and V, ``[num_pages, page_size, Hkv, D]`` each (exact)."""
    (kv,) = cache.arrays
    return kv[:, :, 0::2], kv[:, :, 1::2]


def init_cache(call: PagedCall, num_pages: int) -> KVCache:
    """A zero-filled cache: one buffer, so a jit donating the cache donates all of it."""
    import jax.numpy as jnp

    shape = (num_pages, call.page_size, 2 * call.kv_heads, call.head_dim)
    return KVCache((jnp.zeros(shape, call.dtype),), LAYOUT, call.page_size, num_pages)


def write(call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
    """k, v ``[T, Hkv, D]`` scattered into their slots ``[T]`` of the combined
    layout; a negative slot writes nothing. Only the written rows change: the
    cache is viewed as ``[num_pages * page_size, 2 * Hkv, D]`` rows (a reshape of
    a contiguous array, no copy) and the tokens' interleaved rows are scattered in."""
    import jax.numpy as jnp

    (kv,) = cache.arrays
    flat = cache.num_pages * call.page_size
    # A negative index would wrap around in .at[]; one past the end is dropped.
    where = jnp.where(slots < 0, flat, slots)
    rows = jnp.stack([k, v], axis=2).reshape(k.shape[0], 2 * call.kv_heads, call.head_dim)
    kv = kv.reshape(flat, 2 * call.kv_heads, call.head_dim)
    kv = kv.at[where].set(rows.astype(kv.dtype), mode="drop").reshape(cache.arrays[0].shape)
    return KVCache((kv,), LAYOUT, cache.page_size, cache.num_pages)


def _kernel(*args: Any, **kwargs: Any) -> Any:
    """JAX's kernel, imported when first traced (not when the plugin loads)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention(*args, **kwargs)


def _block_sizes(options: RaggedBlockSizes | None, rows: int,
                 width: int) -> tuple[int | None, int | None]:
    import jax

    if options is None:
        if jax.default_backend() == "tpu":
            return None, None  # the kernel's tuned table for this chip
        options = RaggedBlockSizes()
    return min(options.kv_pages_per_block, width), min(options.queries_per_block, rows)


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    options: RaggedBlockSizes | None) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no sequence owns: zeros."""
    import jax.numpy as jnp

    rows, (seqs, width) = q.shape[0], batch.page_table.shape
    if rows == 0 or seqs == 0:
        return jnp.zeros_like(q)
    (kv,) = cache.arrays
    counted = jnp.arange(seqs) < batch.num_seqs
    # See the module docstring: uncounted sequences are never walked (0 keys),
    # a counted one with no keys gets one nobody sees, so the kernel's chain of
    # prefetches stays in step; every table entry names a page of the pool.
    kv_lens = jnp.where(counted, jnp.maximum(batch.kv_lens, 1), 0).astype(jnp.int32)
    table = jnp.clip(batch.page_table, 0, cache.num_pages - 1).astype(jnp.int32)
    kv_blocks, q_blocks = _block_sizes(options, rows, width)
    out = _kernel(
        q, kv, kv_lens, table, batch.cu_q_lens.astype(jnp.int32),
        batch.num_seqs.reshape(1).astype(jnp.int32),
        sm_scale=call.scale, soft_cap=call.softcap,
        sliding_window=None if call.window is None else call.window[0] + 1,
        num_kv_pages_per_block=kv_blocks, num_queries_per_block=q_blocks)
    # The kernel never stores padding rows: their output is stale scratch.
    owned = jnp.arange(rows) < batch.cu_q_lens[batch.num_seqs]
    return jnp.where(owned[:, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)
