"""The ``heads_first`` paged cache layout: K and V each ``[Hkv, num_pages,
page_size, D]`` (a quantized cache: values so, and K's and V's scales ``[Hkv,
num_pages, page_size]``).

Each kv head's pages are one contiguous pool, so a kernel reading one head's
block of keys reads whole runs of ``page_size * D`` values (JAX's Pallas paged
kernels for TPU and GPU take it; xla_native's matmuls read it without a
transpose). Several backends keep their caches in it; this module is its one
copy of the conversions and the write, and :class:`HeadsFirstPagedBackend` a
:class:`PagedBackend` whose every cache is in it. The conversions are exact
(transposes); the write scatters straight into the layout (no canonical copy).
"""

from __future__ import annotations

from typing import Any

from .paged import KVCache, PagedBackend, PagedCall

#: The layout's name, as :attr:`KVCache.layout` carries it.
LAYOUT = "heads_first"


def _heads_first(x: Any) -> Any:
    """A canonical array ``[num_pages, page_size, Hkv, ...]`` -> ``[Hkv, num_pages,
    page_size, ...]``."""
    return x.transpose(2, 0, 1, *range(3, x.ndim))


def from_canonical(call: PagedCall, k_pages: Any, v_pages: Any, *scales: Any) -> KVCache:
    """K and V ``[num_pages, page_size, Hkv, D]`` (and a quantized call's scales
    ``[num_pages, page_size, Hkv]``) -> a cache of each heads first."""
    arrays = tuple(_heads_first(x) for x in (k_pages, v_pages, *scales))
    return KVCache(arrays, LAYOUT, call.page_size, k_pages.shape[0])


def to_canonical(call: PagedCall, cache: KVCache) -> tuple[Any, ...]:
    """The cache's K and V as ``[num_pages, page_size, Hkv, D]`` each (and a
    quantized cache's scales as ``[num_pages, page_size, Hkv]``)."""
    return tuple(x.transpose(1, 2, 0, *range(3, x.ndim)) for x in cache.arrays)


def init_cache(call: PagedCall, num_pages: int) -> KVCache:
    """Zero-filled K and V ``[Hkv, num_pages, page_size, D]`` (and scales ``[Hkv,
    num_pages, page_size]``), separate buffers, so a jit donating the cache
    donates each."""
    import jax.numpy as jnp

    shape = (call.kv_heads, num_pages, call.page_size, call.head_dim)
    arrays = [jnp.zeros(shape, call.kv_dtype or call.dtype) for _ in range(2)]
    arrays += [jnp.zeros(shape[:3], jnp.float32) for _ in range(2 if call.quantized else 0)]
    return KVCache(tuple(arrays), LAYOUT, call.page_size, num_pages)


def write(call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
    """The cache with k, v ``[T, Hkv, D]`` at ``slots`` int32 ``[T]``
    (``page * page_size + offset``); a negative slot writes nothing. A quantized
    call's tokens are quantized (values and scales written).

    Each pool is viewed as ``[Hkv, num_pages * page_size, ...]`` (two adjacent
    axes merged: no copy) and the tokens scattered into it.
    """
    import jax.numpy as jnp

    flat = cache.num_pages * call.page_size
    # A negative index would wrap around in .at[]; one past the end is dropped.
    where = jnp.where(slots < 0, flat, slots)
    news = [k, v]
    if call.quantized:
        from .paged_quantize import quantize

        (k, k_scale), (v, v_scale) = (quantize(x, call.kv_dtype) for x in (k, v))
        news = [k, v, k_scale, v_scale]
    arrays = []
    for pool, new in zip(cache.arrays, news, strict=True):
        rows = pool.reshape(call.kv_heads, flat, *pool.shape[3:])
        rows = rows.at[:, where].set(new.swapaxes(0, 1).astype(pool.dtype), mode="drop")
        arrays.append(rows.reshape(pool.shape))
    return KVCache(tuple(arrays), LAYOUT, cache.page_size, cache.num_pages)


class HeadsFirstPagedBackend(PagedBackend):
    """A :class:`PagedBackend` whose caches are all ``heads_first``: subclass it in
    place of ``PagedBackend`` and implement only ``attend_paged``, which gets K
    and V ``[Hkv, num_pages, page_size, D]`` in ``cache.arrays``."""

    def cache_layout(self, call: PagedCall) -> str:
        """``"heads_first"``: K and V each ``[Hkv, num_pages, page_size, D]``."""
        return LAYOUT

    def from_canonical(self, call: PagedCall, k_pages: Any, v_pages: Any,
                       *scales: Any) -> KVCache:
        return from_canonical(call, k_pages, v_pages, *scales)

    def to_canonical(self, call: PagedCall, cache: KVCache) -> tuple[Any, ...]:
        return to_canonical(call, cache)

    def init_cache(self, call: PagedCall, num_pages: int) -> KVCache:
        return init_cache(call, num_pages)

    def write(self, call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        """k, v ``[T, Hkv, D]`` scattered straight into the pools at ``slots``."""
        return write(call, cache, k, v, slots)
