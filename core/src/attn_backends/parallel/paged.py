"""Heads-sharded paged attention: the KV heads of the cache, of q and of the new
tokens' k and v split over one mesh axis, each device serving its own heads with
the same paged backend (``shard_map``; no collective: a head never reads another).

Query head h reads kv head ``h // group``, so the i-th contiguous block of query
heads reads exactly the i-th block of kv heads: every device runs the backend's
paged call with ``Hq / n`` query heads over ``Hkv / n`` kv heads, the batch's
metadata replicated. The cache stays in the backend's layout; which axis of each
of its arrays holds the kv heads is read off the layout's shapes, and that a
block of that axis is a block of heads is checked once, exactly, through the
canonical view (``to_canonical``), so a layout that interleaves heads otherwise
is refused, never split wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..choose.paged import PagedAttention, choose_paged, select_paged
from ..contract import jax_api
from ..contract.paged import KVCache, PagedBatch, PagedCall


def _head_axes(paged: PagedAttention, local: PagedCall, n: int) -> tuple[int, ...]:
    """Per array of the cache, the axis that holds the kv heads: the one axis that
    doubles when the per-device call's heads double (and is ``n`` times larger
    in the full call's cache)."""
    backend = paged._paged
    wide = dataclasses.replace(local, q_heads=2 * local.q_heads, kv_heads=2 * local.kv_heads)
    part, twice, full = (jax.eval_shape(lambda c=c: backend.init_cache(c, 1)).arrays
                         for c in (local, wide, paged.call))
    axes = []
    for i, (p, w, f) in enumerate(zip(part, twice, full, strict=True)):
        differ = [a for a, (x, y) in enumerate(zip(p.shape, w.shape, strict=True)) if x != y]
        ax = differ[0] if len(differ) == 1 and w.shape[differ[0]] == 2 * p.shape[differ[0]] \
            else None
        if ax is None or f.shape != p.shape[:ax] + (n * p.shape[ax],) + p.shape[ax + 1:]:
            raise ValueError(
                f"shard_paged_heads: layout {paged.layout!r} of {paged.backend.name!r}: cache "
                f"array {i} is {list(p.shape)} for {local.kv_heads} kv heads, "
                f"{list(w.shape)} for {wide.kv_heads} and {list(f.shape)} for "
                f"{paged.call.kv_heads}; expected one axis that grows with the heads, so the "
                "layout cannot be split over heads")
        axes.append(ax)
    return tuple(axes)


def _check_blocks(paged: PagedAttention, local: PagedCall, axes: tuple[int, ...],
                  n: int) -> None:
    """A block of each head axis is a block of kv heads: exact, on one page of
    distinct values, through the canonical view."""
    backend = paged._paged
    call = paged.call
    shape = (1, call.page_size, call.kv_heads, call.head_dim)
    # Distinct values in the cache's dtype; a quantized cache's as byte patterns
    # (a cast of a count would collapse or overflow in float8), and its scales.
    k = np.arange(np.prod(shape)).reshape(shape).astype(call.dtype)
    if call.quantized:
        stored = jax.numpy.dtype(call.kv_dtype)
        k = (k.astype(np.int64) % 256).astype(np.uint8).view(stored)
    wants = [k, np.flip(k, 1)]
    if call.quantized:
        scales = np.arange(np.prod(shape[:3]), dtype=np.float32).reshape(shape[:3])
        wants += [scales, np.flip(scales, 1)]
    full = backend.from_canonical(call, *wants)
    per = call.kv_heads // n
    for i in range(n):
        arrays = tuple(np.split(np.asarray(a), n, axis=ax)[i]
                       for a, ax in zip(full.arrays, axes, strict=True))
        got = backend.to_canonical(local, KVCache(arrays, full.layout, full.page_size, 1))
        heads = slice(i * per, (i + 1) * per)
        # Bytes, not values: a float8 pattern may be NaN.
        if not all(np.asarray(g).tobytes() == np.ascontiguousarray(w[:, :, heads]).tobytes()
                   for g, w in zip(got, wants, strict=True)):
            raise ValueError(
                f"shard_paged_heads: layout {paged.layout!r} of {paged.backend.name!r} does "
                f"not keep kv heads in contiguous blocks: block {i} of its head axes is not "
                f"kv heads {heads.start}..{heads.stop - 1}, so it cannot be split over heads")


class HeadsShardedPaged:
    """A paged attention with its kv heads split over mesh axis ``axis``.

    Made by :func:`shard_paged_heads`. Same methods as
    :class:`~attn_backends.choose.paged.PagedAttention`, on global arrays: q ``[T,
    Hq, D]`` and out sharded over ``axis`` on the heads axis; k, v ``[T, Hkv, D]``
    likewise; the cache's arrays on their heads axis; ``slots`` and the batch
    replicated. ``local`` is the per-device attention (``Hq / n`` over ``Hkv / n``).
    """

    def __init__(self, paged: PagedAttention, local: PagedAttention, mesh: Any, axis: str,
                 head_axes: tuple[int, ...]):
        self.paged, self.local, self.mesh, self.axis = paged, local, mesh, axis
        self.call = paged.call
        self.layout = paged.layout
        self._cache_specs = tuple(
            P(*(axis if a == ax else None for a in range(ndim)))
            for ax, ndim in zip(head_axes, self._ndims(), strict=True))
        self._heads = P(None, axis, None)

    def __repr__(self) -> str:
        return (f"<HeadsShardedPaged {self.call.describe()} backend={self.paged.backend.name!r}"
                f" heads over {self.axis!r} ({self.mesh.shape[self.axis]})>")

    def _ndims(self) -> tuple[int, ...]:
        cache = jax.eval_shape(lambda: self.paged._paged.init_cache(self.call, 1))
        return tuple(len(a.shape) for a in cache.arrays)

    def _map(self, body: Any, in_specs: tuple[Any, ...], out_specs: Any) -> Any:
        return jax_api.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                                 out_specs=out_specs, check_vma=False)

    def init_cache(self, num_pages: int) -> KVCache:
        """A zero-filled cache of ``num_pages`` pages, each array laid out with its
        heads axis over ``axis``."""
        cache = self.paged.init_cache(num_pages)
        arrays = tuple(jax.device_put(a, NamedSharding(self.mesh, spec))
                       for a, spec in zip(cache.arrays, self._cache_specs, strict=True))
        return KVCache(arrays, cache.layout, cache.page_size, cache.num_pages)

    def write(self, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        """As ``PagedAttention.write``, each device writing its own heads."""
        self.paged._check_cache(cache)

        def body(arrays: tuple[Any, ...], k: Any, v: Any, slots: Any) -> tuple[Any, ...]:
            local = KVCache(arrays, cache.layout, cache.page_size, cache.num_pages)
            return self.local.write(local, k, v, slots).arrays

        specs = self._cache_specs
        arrays = self._map(body, (specs, self._heads, self._heads, P()), specs)(
            cache.arrays, k, v, slots)
        return KVCache(arrays, cache.layout, cache.page_size, cache.num_pages)

    def __call__(self, q: Any, cache: KVCache, batch: PagedBatch) -> Any:
        """As ``PagedAttention.__call__``: q ``[T, Hq, D]`` -> out ``[T, Hq, D]``,
        each device attending with its own heads over the replicated batch."""
        self.paged._check_cache(cache)

        def body(q: Any, arrays: tuple[Any, ...], batch: PagedBatch) -> Any:
            local = KVCache(arrays, cache.layout, cache.page_size, cache.num_pages)
            return self.local(q, local, batch)

        return self._map(body, (self._heads, self._cache_specs, P()), self._heads)(
            q, cache.arrays, PagedBatch(*batch))


def shard_paged_heads(paged: PagedAttention, mesh: Any, axis: str) -> HeadsShardedPaged:
    """``paged`` (got with ``registry.get_paged``) with its kv heads split over
    ``mesh`` axis ``axis`` of ``n`` devices: each device serves ``Hq / n`` query
    heads over ``Hkv / n`` kv heads with the same backend and layout.

    Raises ``ValueError`` when ``Hkv`` is not a multiple of ``n`` or the layout
    does not split by heads, ``UnsupportedError`` when the backend refuses the
    per-device call (with its reasons).
    """
    if axis not in mesh.shape:
        raise ValueError(f"axis: expected one of the mesh's axes {list(mesh.shape)}, got {axis!r}")
    if paged.local:  # a multi-process run's: choose/local.py is loaded there
        from ..choose.local import require_local, spans

        require_local(f"paged attention {paged.call.describe()} split over {axis!r}",
                      spans({}, [(mesh, "the mesh")]))
    n = int(mesh.shape[axis])
    call = paged.call
    if call.kv_heads % n:
        raise ValueError(f"shard_paged_heads: num_kv_heads={call.kv_heads} must be a multiple "
                         f"of the {n} devices of mesh axis {axis!r}")
    local_call = dataclasses.replace(call, q_heads=call.q_heads // n,
                                     kv_heads=call.kv_heads // n)
    platform = paged.explanation.platform
    explanation = select_paged(local_call, platform, [paged.backend],
                               jax_version=jax.__version__, present=paged.present)
    choose_paged(explanation, pinned=paged.backend.name, fallback="silent")
    local = PagedAttention(local_call, paged.backend, explanation, present=paged.present,
                           options=paged.options)
    axes = _head_axes(paged, local_call, n)
    _check_blocks(paged, local_call, axes, n)
    return HeadsShardedPaged(paged, local, mesh, axis, axes)
