"""The paged KV-cache contract (serving; docs/DESIGN.md, "Paged attention").

A serving engine keeps one pool of fixed-size pages, a page table per sequence
and ragged batches that mix prefill chunks with decode steps. This module holds
what that contract is made of, below any device:

- :class:`PagedCall`, the frozen, hashable static description of a paged
  attention (heads, head dim, page size, dtype, scale, softcap, window,
  ``max_q_len``), what selection and every paged backend read;
- :class:`PagedBatch`, the ragged batch's metadata arrays;
- :class:`KVCache`, the cache pytree, in the layout of the backend that made it;
- :class:`PagedCapabilities`, the manifest of a backend's paged support;
- :class:`PagedBackend`, the methods a backend adds to serve paged calls;
- the canonical layout's write, which a backend with its own layout may reuse.

The validation of every argument is in :mod:`.paged_bind`, loaded with the first
``get_paged``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .call import WIDE_DTYPES
from .capabilities import Manifest
from .errors import UnsupportedError, renamed

#: The layout every paged backend converts to and from: K and V each
#: ``[num_pages, page_size, Hkv, D]``. A backend may also keep its cache in it.
CANONICAL_LAYOUT = "canonical"

#: Paged call features a :class:`PagedCapabilities` manifest may claim.
PAGED_FEATURES = ("gqa", "softcap", "window")

#: The names of a cache's arrays in the canonical view, in order: K and V, and
#: for a quantized cache their scales.
CANONICAL_ARRAYS = ("k_pages", "v_pages", "k_scales", "v_scales")


@dataclass(frozen=True)
class PagedCall:
    """Static description of one paged attention; hashable, so it keys selections.

    q ``[T, q_heads, head_dim]``; the cache holds K and V of ``kv_heads`` heads
    and ``head_dim`` dims in pages of ``page_size`` positions. ``window`` is
    ``(left, None)`` or None (paged attention is causal). ``max_q_len`` is the
    most query rows one sequence may have in a batch (1: decode steps only), or
    None for any.
    """

    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    scale: float
    softcap: float | None = None
    window: tuple[int, None] | None = None
    max_q_len: int | None = None
    #: The platform the program is made for, set by core before it calls a
    #: paged backend; None elsewhere (a backend called directly).
    platform: str | None = None
    #: One of :data:`QUANTIZED_KV_DTYPES` when the cache is stored quantized
    #: (values and float32 scales); None: the cache holds K and V in ``dtype``.
    kv_dtype: str | None = None

    @property
    def cache_dtype(self) -> str | None:
        """``kv_dtype``'s name before 0.2 (deprecated)."""
        renamed("PagedCall.cache_dtype", "PagedCall.kv_dtype")
        return self.kv_dtype

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head ``h // group``."""
        return self.q_heads // self.kv_heads

    @property
    def accumulation_dtype(self) -> str:
        """float32, or float64 for a float64 call (x64), as in the dense contract."""
        return "float64" if self.dtype in WIDE_DTYPES else "float32"

    @property
    def quantized(self) -> bool:
        """Whether the cache holds quantized values and their scales."""
        return self.kv_dtype is not None

    @property
    def features(self) -> frozenset[str]:
        """The subset of :data:`PAGED_FEATURES` this call uses."""
        used = {"gqa": self.group > 1, "softcap": self.softcap is not None,
                "window": self.window is not None}
        return frozenset(f for f, on in used.items() if on)

    def describe(self) -> str:
        """One line for people: heads, head dim, pages, dtype and the features used."""
        text = (f"paged q[T,{self.q_heads},{self.head_dim}] kv heads {self.kv_heads} "
                f"page_size {self.page_size} {self.dtype}")
        extras = [f"window={self.window}" if f == "window" else f
                  for f in PAGED_FEATURES if f in self.features]
        if self.max_q_len is not None:
            extras.append(f"max_q_len={self.max_q_len}")
        if self.kv_dtype is not None:
            extras.append(f"kv_dtype={self.kv_dtype}")
        return text + (" " + " ".join(extras) if extras else "")


class PagedBatch(NamedTuple):
    """A ragged batch's metadata (a pytree: it passes through ``jit`` as arrays).

    ``cu_q_lens`` int32 ``[S+1]``: sequence s owns query rows ``cu_q_lens[s] ..
    cu_q_lens[s+1]-1``; ``kv_lens`` int32 ``[S]``: its keys are at positions
    ``0 .. kv_lens[s]-1`` (its new rows' own keys included: write, then attend);
    ``page_table`` int32 ``[S, P]``: position p lives in page
    ``page_table[s, p // page_size]`` at offset ``p % page_size``; ``num_seqs``
    int32 scalar or ``[1]``: only the first ``num_seqs`` sequences count.
    """

    cu_q_lens: Any
    kv_lens: Any
    page_table: Any
    num_seqs: Any


# eq=False: comparing caches would compare arrays elementwise; a cache is a value
# of arrays, identified by its layout, not a key.
@dataclass(frozen=True, eq=False)
class KVCache:
    """A paged KV cache: the pool's arrays in ``layout``, the layout of the backend
    that made it (``arrays`` are pytree children; ``layout``, ``page_size`` and
    ``num_pages`` are static). Make it with ``PagedAttention.init_cache``; move it
    to another layout through the canonical view (``to_canonical`` /
    ``from_canonical``)."""

    arrays: tuple[Any, ...]
    layout: str
    page_size: int
    num_pages: int

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, int, int]]:
        return tuple(self.arrays), (self.layout, self.page_size, self.num_pages)

    @classmethod
    def tree_unflatten(cls, aux: tuple[str, int, int], children: Any) -> KVCache:
        return cls(tuple(children), *aux)


def _register_kv_cache() -> None:
    import jax

    jax.tree_util.register_pytree_node(KVCache, KVCache.tree_flatten, KVCache.tree_unflatten)


_register_kv_cache()


@dataclass(frozen=True)
class PagedCapabilities(Manifest):
    """What a backend's paged support can serve; read by selection at ``get_paged``.

    :class:`~attn_backends.contract.capabilities.Manifest`'s fields (``gqa``,
    ``softcap`` and ``window`` name :data:`PAGED_FEATURES`), and:
    ``page_sizes``: the page sizes it takes (None: any); ``max_q_len``: the most
    query rows per sequence it serves (None: any; 1: decode steps only), so a
    call whose ``max_q_len`` is None or larger is refused.
    """

    page_sizes: frozenset[int] | None = None
    max_q_len: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_sizes is not None:
            object.__setattr__(self, "page_sizes", frozenset(self.page_sizes))

    @property
    def features(self) -> frozenset[str]:
        return frozenset(f for f in PAGED_FEATURES if getattr(self, f))

    @property
    def cache_dtypes(self) -> frozenset[str]:
        """``kv_dtypes``' name before 0.2 (deprecated)."""
        renamed("PagedCapabilities.cache_dtypes", "PagedCapabilities.kv_dtypes")
        return self.kv_dtypes

    def unmet(self, call: PagedCall, platform: str) -> list[str]:
        """Every reason this manifest excludes ``call`` on ``platform``; empty if none."""
        extra = []
        if self.page_sizes is not None and call.page_size not in self.page_sizes:
            extra.append(f"page_size={call.page_size} not in {sorted(self.page_sizes)}")
        if self.max_q_len is not None and (call.max_q_len is None
                                           or call.max_q_len > self.max_q_len):
            extra.append(f"max_q_len={call.max_q_len}: serves at most {self.max_q_len} "
                         "query rows per sequence")
        return self.unmet_by(call, platform, (call.head_dim,), extra)


_init_paged_capabilities = PagedCapabilities.__init__


def _paged_capabilities_init(self: PagedCapabilities, *args: Any, cache_dtypes: Any = None,
                             **kwargs: Any) -> None:
    # ``cache_dtypes=``, kv_dtypes' name before 0.2, still works for a release.
    if cache_dtypes is not None:
        renamed("PagedCapabilities(cache_dtypes=)", "PagedCapabilities(kv_dtypes=)")
        kwargs.setdefault("kv_dtypes", cache_dtypes)
    _init_paged_capabilities(self, *args, **kwargs)


PagedCapabilities.__init__ = _paged_capabilities_init  # type: ignore[method-assign]


class PagedBackend(abc.ABC):
    """The paged methods a :class:`~attn_backends.Backend` adds to serve paged calls.

    A backend serving paged calls subclasses both ``Backend`` and this, sets
    ``paged_capabilities`` and implements :meth:`attend_paged`. Its cache layout
    is :data:`CANONICAL_LAYOUT` unless it overrides :meth:`cache_layout`, and
    then also :meth:`from_canonical`, :meth:`to_canonical` and :meth:`write`
    (:meth:`init_cache` is ``from_canonical`` of zeros). Core validates every
    argument before a method runs, so none re-checks shapes.
    """

    paged_capabilities: ClassVar[PagedCapabilities]

    def check_paged(self, call: PagedCall) -> list[str]:
        """Reasons it cannot serve ``call`` beyond its paged manifest; empty if it can."""
        return []

    def cache_layout(self, call: PagedCall) -> str:
        """The name of the layout its caches for ``call`` are in (one name, one layout)."""
        return CANONICAL_LAYOUT

    def from_canonical(self, call: PagedCall, k_pages: Any, v_pages: Any,
                       *scales: Any) -> KVCache:
        """K and V ``[num_pages, page_size, Hkv, D]`` as a cache in its layout (exact);
        for a quantized call also their ``scales``, K's and V's float32 ``[num_pages,
        page_size, Hkv]``."""
        self._require_canonical(call, "from_canonical")
        return KVCache((k_pages, v_pages, *scales), CANONICAL_LAYOUT, call.page_size,
                       k_pages.shape[0])

    def to_canonical(self, call: PagedCall, cache: KVCache) -> tuple[Any, ...]:
        """The cache's K and V as ``[num_pages, page_size, Hkv, D]`` each (exact), and
        for a quantized call their scales ``[num_pages, page_size, Hkv]`` each."""
        self._require_canonical(call, "to_canonical")
        return tuple(cache.arrays)

    def init_cache(self, call: PagedCall, num_pages: int) -> KVCache:
        """A zero-filled cache of ``num_pages`` pages in its layout."""
        import jax.numpy as jnp

        shape = (num_pages, call.page_size, call.kv_heads, call.head_dim)
        # Separate buffers, not one twice: a jit donating the cache donates each.
        values = [jnp.zeros(shape, call.kv_dtype or call.dtype) for _ in range(2)]
        scales = [jnp.zeros(shape[:3], "float32") for _ in range(2 if call.quantized else 0)]
        return self.from_canonical(call, *values, *scales)

    def write(self, call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        """The cache with k, v ``[T, Hkv, D]`` at ``slots`` int32 ``[T]``
        (``page * page_size + offset``); a negative slot writes nothing."""
        self._require_canonical(call, "write")
        k_pages, v_pages, *scales = cache.arrays
        pages = canonical_write(call, k_pages, v_pages, k, v, slots, *scales)
        return KVCache(pages, cache.layout, cache.page_size, cache.num_pages)

    @abc.abstractmethod
    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """Paged attention: q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` in q's dtype
        (docs/DESIGN.md, "Paged attention", for the batch's meaning); rows past
        ``cu_q_lens[num_seqs]`` output zeros. ``num_seqs`` arrives as a scalar."""

    def _require_canonical(self, call: PagedCall, method: str) -> None:
        layout = self.cache_layout(call)
        if layout != CANONICAL_LAYOUT:
            raise UnsupportedError(
                f"backend {getattr(self, 'name', type(self).__name__)!r} keeps its cache in "
                f"layout {layout!r} but does not override PagedBackend.{method}; a backend "
                "with its own layout implements from_canonical, to_canonical and write")


def canonical_write(call: PagedCall, k_pages: Any, v_pages: Any, k: Any, v: Any,
                    slots: Any, *scales: Any) -> tuple[Any, ...]:
    """K and V ``[num_pages, page_size, Hkv, D]`` with k, v ``[T, Hkv, D]`` put at
    ``slots`` ``[T]``; a negative slot (padding) writes nothing. For a quantized
    call ``scales`` are K's and V's ``[num_pages, page_size, Hkv]``: each token is
    quantized (:func:`attn_backends.authoring.quantize`) and its values and scales
    written; the result is then (K, V, K's scales, V's scales). A backend with its
    own layout may write through the canonical view with it."""
    import jax.numpy as jnp

    flat = k_pages.shape[0] * call.page_size
    # A negative index would wrap around in .at[]; an index past the end is dropped.
    where = jnp.where(slots < 0, flat, slots)
    pools, news = [k_pages, v_pages], [k, v]
    if call.quantized:
        from .paged_quantize import quantize

        (k, k_scale), (v, v_scale) = (quantize(x, call.kv_dtype) for x in (k, v))
        pools, news = [k_pages, v_pages, *scales], [k, v, k_scale, v_scale]
    out = []
    for pool, new in zip(pools, news, strict=True):
        rows = pool.reshape(flat, *pool.shape[2:])
        out.append(rows.at[where].set(new.astype(pool.dtype), mode="drop").reshape(pool.shape))
    return tuple(out)
