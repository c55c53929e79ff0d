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
- the validation of every argument (``ValueError`` naming it, expected vs got).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .call import DTYPES, WIDE_DTYPES, _check_float, _check_scale, _check_softcap
from .capabilities import CLAIMABLE_DTYPES, HeadDims, validate_spec
from .environment import PLATFORMS, check_platform
from .errors import UnsupportedError

#: The layout every paged backend converts to and from: K and V each
#: ``[num_pages, page_size, Hkv, D]``. A backend may also keep its cache in it.
CANONICAL_LAYOUT = "canonical"

#: Paged call features a :class:`PagedCapabilities` manifest may claim.
PAGED_FEATURES = ("gqa", "softcap", "window")


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

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head ``h // group``."""
        return self.q_heads // self.kv_heads

    @property
    def accumulation_dtype(self) -> str:
        """float32, or float64 for a float64 call (x64), as in the dense contract."""
        return "float64" if self.dtype in WIDE_DTYPES else "float32"

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
class PagedCapabilities:
    """What a backend's paged support can serve; read by selection at ``get_paged``.

    ``page_sizes``: the page sizes it takes (None: any); ``max_q_len``: the most
    query rows per sequence it serves (None: any; 1: decode steps only), so a
    call whose ``max_q_len`` is None or larger is refused.
    """

    platforms: frozenset[str]
    dtypes: frozenset[str] = DTYPES
    head_dims: HeadDims = field(default_factory=HeadDims)
    page_sizes: frozenset[int] | None = None
    max_q_len: int | None = None
    gqa: bool = False
    softcap: bool = False
    window: bool = False
    jax_versions: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "platforms", frozenset(self.platforms))
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        if self.page_sizes is not None:
            object.__setattr__(self, "page_sizes", frozenset(self.page_sizes))
        if not self.platforms:
            raise ValueError(
                f"PagedCapabilities: platforms is empty; name at least one of {sorted(PLATFORMS)}")
        for platform in sorted(self.platforms):
            check_platform(platform, "PagedCapabilities: platforms")
        if not self.dtypes or not self.dtypes <= CLAIMABLE_DTYPES:
            raise ValueError(f"PagedCapabilities: dtypes={sorted(self.dtypes)} must be a "
                             f"non-empty subset of {sorted(CLAIMABLE_DTYPES)}")
        validate_spec(self.jax_versions)

    @property
    def features(self) -> frozenset[str]:
        return frozenset(f for f in PAGED_FEATURES if getattr(self, f))

    def unmet(self, call: PagedCall, platform: str) -> list[str]:
        """Every reason this manifest excludes ``call`` on ``platform``; empty if none."""
        reasons = []
        if platform not in self.platforms:
            reasons.append(f"platform {platform!r} not in {sorted(self.platforms)}")
        if call.dtype not in self.dtypes:
            reasons.append(f"dtype {call.dtype} not in {sorted(self.dtypes)}")
        reasons += self.head_dims.reasons(call.head_dim, "head_dim")
        if self.page_sizes is not None and call.page_size not in self.page_sizes:
            reasons.append(f"page_size={call.page_size} not in {sorted(self.page_sizes)}")
        if self.max_q_len is not None and (call.max_q_len is None
                                           or call.max_q_len > self.max_q_len):
            reasons.append(f"max_q_len={call.max_q_len}: serves at most {self.max_q_len} "
                           "query rows per sequence")
        for feature in sorted(call.features - self.features):
            reasons.append(f"feature {feature!r} not supported")
        return reasons

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, HeadDims):
                value = value.describe()
            out[f.name] = value
        return out


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

    def from_canonical(self, call: PagedCall, k_pages: Any, v_pages: Any) -> KVCache:
        """K and V ``[num_pages, page_size, Hkv, D]`` as a cache in its layout (exact)."""
        self._require_canonical(call, "from_canonical")
        return KVCache((k_pages, v_pages), CANONICAL_LAYOUT, call.page_size, k_pages.shape[0])

    def to_canonical(self, call: PagedCall, cache: KVCache) -> tuple[Any, Any]:
        """The cache's K and V as ``[num_pages, page_size, Hkv, D]`` each (exact)."""
        self._require_canonical(call, "to_canonical")
        return cache.arrays[0], cache.arrays[1]

    def init_cache(self, call: PagedCall, num_pages: int) -> KVCache:
        """A zero-filled cache of ``num_pages`` pages in its layout."""
        import jax.numpy as jnp

        shape = (num_pages, call.page_size, call.kv_heads, call.head_dim)
        # Two buffers, not one twice: a jit donating the cache donates each.
        return self.from_canonical(call, jnp.zeros(shape, call.dtype),
                                   jnp.zeros(shape, call.dtype))

    def write(self, call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        """The cache with k, v ``[T, Hkv, D]`` at ``slots`` int32 ``[T]``
        (``page * page_size + offset``); a negative slot writes nothing."""
        self._require_canonical(call, "write")
        pages = canonical_write(call, *cache.arrays, k, v, slots)
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
                    slots: Any) -> tuple[Any, Any]:
    """K and V ``[num_pages, page_size, Hkv, D]`` with k, v ``[T, Hkv, D]`` put at
    ``slots`` ``[T]``; a negative slot (padding) writes nothing. A backend with its
    own layout may write through the canonical view with it."""
    import jax.numpy as jnp

    flat = k_pages.shape[0] * call.page_size
    # A negative index would wrap around in .at[]; an index past the end is dropped.
    where = jnp.where(slots < 0, flat, slots)
    out = []
    for pages, new in zip((k_pages, v_pages), (k, v), strict=True):
        rows = pages.reshape(flat, call.kv_heads, call.head_dim)
        out.append(rows.at[where].set(new.astype(pages.dtype), mode="drop").reshape(pages.shape))
    return out[0], out[1]


def _static_int(name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected a static Python int >= {low}, "
                         f"got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {int(value)}")
    return int(value)


def _paged_window(window: Any) -> tuple[int, None] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected (left, None) with left an int >= 0, got {window!r}")
    left, right = window
    if right is not None:
        raise ValueError(
            f"window: expected (left, None), got right side {right!r}; paged attention is "
            "causal, so no row sees a key after its own position")
    if left is None:
        return None
    return (_static_int("window left side", left, low=0), None)


def bind_paged(*, num_q_heads: Any, num_kv_heads: Any, head_dim: Any, page_size: Any,
               dtype: Any, scale: Any = None, softcap: Any = None, window: Any = None,
               max_q_len: Any = None) -> PagedCall:
    """Validate ``registry.get_paged``'s call arguments into a :class:`PagedCall`.

    Raises ``ValueError`` naming the bad argument, what was expected and what arrived.
    """
    hq = _static_int("num_q_heads", num_q_heads, low=1)
    hkv = _static_int("num_kv_heads", num_kv_heads, low=1)
    if hq % hkv:
        raise ValueError(f"num_q_heads, num_kv_heads: expected num_q_heads={hq} to be a "
                         f"multiple of num_kv_heads={hkv} (GQA/MQA)")
    d = _static_int("head_dim", head_dim, low=1)
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise ValueError(f"dtype: expected a float dtype (float32, bfloat16, float16), "
                         f"got {dtype!r}") from exc
    _check_float("dtype", name)
    if max_q_len is not None:
        max_q_len = _static_int("max_q_len", max_q_len, low=1)
    scale = _check_scale(scale, d)
    return PagedCall(q_heads=hq, kv_heads=hkv, head_dim=d,
                     page_size=_static_int("page_size", page_size, low=1), dtype=name,
                     scale=scale, softcap=_check_softcap(softcap),
                     window=_paged_window(window), max_q_len=max_q_len)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def _array(name: str, x: Any, shape: tuple[int | None, ...], kind: str) -> tuple[int, ...]:
    """Check ``x`` is an array of ``shape`` (None: any size) and dtype kind."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name}: expected an array (jax.Array, numpy array or "
                         f"ShapeDtypeStruct), got {type(x).__name__}")
    got = _shape(x)
    if len(got) != len(shape) or any(
            w is not None and w != g for w, g in zip(shape, got, strict=True)):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise ValueError(f"{name}: expected shape [{want}], got {list(got)}")
    dt = np.dtype(x.dtype)
    if kind == "int" and not np.issubdtype(dt, np.integer):
        raise ValueError(f"{name}: expected an integer dtype (int32), got {dt.name}")
    if kind != "int" and dt.name != kind:
        raise ValueError(f"{name}: expected dtype {kind} (the paged attention's dtype), "
                         f"got {dt.name}")
    return got


def check_cache(call: PagedCall, cache: Any, layout: str, expected: Any) -> None:
    """``cache`` is a :class:`KVCache` in ``layout`` whose arrays match ``expected``
    (the shapes and dtypes ``init_cache`` gives for its ``num_pages``)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected an attn_backends.KVCache (from "
                         f"PagedAttention.init_cache), got {type(cache).__name__}")
    if cache.layout != layout:
        raise ValueError(
            f"cache: expected layout {layout!r} (the serving backend's), got a cache in "
            f"layout {cache.layout!r}; move it with to_canonical on the attention that made "
            "it and from_canonical on this one")
    if cache.page_size != call.page_size:
        raise ValueError(f"cache: expected page_size {call.page_size}, got {cache.page_size}")
    got = [(_shape(a), np.dtype(a.dtype).name) for a in cache.arrays]
    want = [(_shape(a), np.dtype(a.dtype).name) for a in expected.arrays]
    if got != want:
        raise ValueError(f"cache: expected arrays (shape, dtype) {want} for "
                         f"{cache.num_pages} pages, got {got}")


def check_write(call: PagedCall, k: Any, v: Any, slots: Any) -> None:
    """k, v ``[T, Hkv, D]`` in the call's dtype; slots integer ``[T]``."""
    t = _array("k", k, (None, call.kv_heads, call.head_dim), call.dtype)[0]
    _array("v", v, (t, call.kv_heads, call.head_dim), call.dtype)
    _array("slots", slots, (t,), "int")


def check_attend(call: PagedCall, q: Any, batch: Any) -> None:
    """q ``[T, Hq, D]`` in the call's dtype; ``batch`` a :class:`PagedBatch` of
    integer arrays ``[S+1]``, ``[S]``, ``[S, P]`` and a scalar or ``[1]``."""
    _array("q", q, (None, call.q_heads, call.head_dim), call.dtype)
    if not isinstance(batch, PagedBatch):
        raise ValueError(f"batch: expected an attn_backends.PagedBatch(cu_q_lens, kv_lens, "
                         f"page_table, num_seqs), got {type(batch).__name__}")
    s = _array("batch.kv_lens", batch.kv_lens, (None,), "int")[0]
    _array("batch.cu_q_lens", batch.cu_q_lens, (s + 1,), "int")
    _array("batch.page_table", batch.page_table, (s, None), "int")
    num = batch.num_seqs
    if not hasattr(num, "shape"):
        raise ValueError(f"batch.num_seqs: expected an int32 scalar or [1] array, "
                         f"got {type(num).__name__}")
    _array("batch.num_seqs", num, (1,) if _shape(num) == (1,) else (), "int")


def check_batch_values(call: PagedCall, q_rows: int, num_pages: int, cu: np.ndarray,
                       kv: np.ndarray, table: np.ndarray, num: int) -> None:
    """The values of a concrete batch (eager calls only: under ``jit`` they are
    traced and unchecked, except ``max_q_len``: docs/DESIGN.md)."""
    s = kv.shape[0]
    if not 0 <= num <= s:
        raise ValueError(f"batch.num_seqs: expected 0 <= num_seqs <= {s} (the table's "
                         f"rows), got {num}")
    cu, kv = cu[: num + 1], kv[:num]
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > q_rows:
        raise ValueError(f"batch.cu_q_lens: expected to start at 0 and not decrease up to "
                         f"cu_q_lens[num_seqs] <= {q_rows} (q's rows), got {cu.tolist()}")
    q_lens = np.diff(cu)
    if np.any(kv < q_lens) or np.any(kv > table.shape[1] * call.page_size):
        raise ValueError(
            f"batch.kv_lens: expected q_len <= kv_len <= {table.shape[1] * call.page_size} "
            f"(the table's pages times page_size) per sequence, got kv_lens {kv.tolist()} "
            f"for q_lens {q_lens.tolist()}")
    if call.max_q_len is not None and q_lens.size and q_lens.max() > call.max_q_len:
        seq = int(np.argmax(q_lens))
        raise ValueError(f"batch: sequence {seq} has {int(q_lens[seq])} query rows, more "
                         f"than max_q_len={call.max_q_len}")
    for seq in range(num):
        used = table[seq, : -(-int(kv[seq]) // call.page_size)]
        if np.any((used < 0) | (used >= num_pages)):
            raise ValueError(f"batch.page_table: sequence {seq} references pages "
                             f"{used.tolist()}, expected each in [0, {num_pages})")
