"""Validation of the paged contract's arguments (docs/DESIGN.md, "Paged attention"):
every bad one raises ``ValueError`` naming it, what was expected and what arrived,
before a backend runs. Loaded with the first ``get_paged``, not by ``import
attn_backends``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arguments import check_float, check_scale, check_softcap
from .call import QUANTIZED_KV_DTYPES
from .errors import renamed
from .paged import CANONICAL_ARRAYS, KVCache, PagedBatch, PagedCall


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


def _kv_dtype(kv_dtype: Any, dtype: str) -> str | None:
    """The quantized dtype the cache is stored in, or None (the call's dtype)."""
    if kv_dtype is None:
        return None
    try:
        name = np.dtype(kv_dtype).name
    except TypeError:
        name = str(kv_dtype)
    if name == dtype:
        return None
    if name not in QUANTIZED_KV_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {list(QUANTIZED_KV_DTYPES)} (a "
                         f"quantized cache), None or dtype={dtype!r} (a cache in the call's "
                         f"dtype), got {kv_dtype!r}")
    return name


def bind_paged(*, num_q_heads: Any, num_kv_heads: Any, head_dim: Any, page_size: Any,
               dtype: Any, scale: Any = None, softcap: Any = None, window: Any = None,
               max_q_len: Any = None, kv_dtype: Any = None,
               cache_dtype: Any = None) -> PagedCall:
    """Validate ``registry.get_paged``'s call arguments into a :class:`PagedCall`
    (``cache_dtype``: ``kv_dtype``'s name before 0.2, deprecated).

    Raises ``ValueError`` naming the bad argument, what was expected and what arrived.
    """
    if cache_dtype is not None:
        renamed("cache_dtype=", "kv_dtype=")
        kv_dtype = cache_dtype if kv_dtype is None else kv_dtype
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
    check_float("dtype", name)
    if max_q_len is not None:
        max_q_len = _static_int("max_q_len", max_q_len, low=1)
    scale = check_scale(scale, d)
    return PagedCall(q_heads=hq, kv_heads=hkv, head_dim=d,
                     page_size=_static_int("page_size", page_size, low=1), dtype=name,
                     scale=scale, softcap=check_softcap(softcap),
                     window=_paged_window(window), max_q_len=max_q_len,
                     kv_dtype=_kv_dtype(kv_dtype, name))


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def _array(name: str, x: Any, shape: tuple[int | None, ...], kind: str,
           why: str = "the paged attention's dtype") -> tuple[int, ...]:
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
        raise ValueError(f"{name}: expected dtype {kind} ({why}), got {dt.name}")
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
    if len(got) != len(want):
        raise ValueError(f"cache: {_quantization_mismatch(call, got)}")
    for name, g, w in zip(CANONICAL_ARRAYS, got, want, strict=False):
        if g != w:
            raise ValueError(
                f"cache: expected its {name} (layout {layout!r}, {cache.num_pages} pages) of "
                f"shape {list(w[0])} and dtype {w[1]}, got shape {list(g[0])} and dtype "
                f"{g[1]}")


def _quantization_mismatch(call: PagedCall, got: list[tuple[tuple[int, ...], str]]) -> str:
    """Why a cache of ``got``'s arrays does not fit ``call``: it is quantized and the
    call is not, or the other way round."""
    dtypes = ", ".join(d for _, d in got)
    if call.quantized:
        return (f"expected a {call.kv_dtype} cache of values and scales (4 arrays: "
                f"{', '.join(CANONICAL_ARRAYS)}), got {len(got)} arrays ({dtypes}): a cache "
                "in the call's dtype")
    if len(got) != 4:
        return (f"expected 2 arrays (k_pages, v_pages in {call.dtype}), got {len(got)} "
                f"({dtypes or 'none'})")
    return (f"got a quantized cache ({len(got)} arrays: {dtypes}), but this paged attention "
            f"was got for a {call.dtype} cache; get it with registry.get_paged(..., "
            f"kv_dtype={got[0][1]!r})")


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


def check_canonical(call: PagedCall, k_pages: Any, v_pages: Any, k_scales: Any,
                    v_scales: Any) -> tuple[Any, ...]:
    """The canonical view's arrays for ``from_canonical``: K and V ``[num_pages,
    page_size, Hkv, D]`` in the call's dtype, or its ``kv_dtype`` with scales
    float32 ``[num_pages, page_size, Hkv]``; the arrays to pass on, in order."""
    given = {"k_pages": k_pages, "v_pages": v_pages, "k_scales": k_scales, "v_scales": v_scales}
    want = (call.page_size, call.kv_heads, call.head_dim)
    values = call.kv_dtype or call.dtype
    for name in ("k_pages", "v_pages"):
        x = given[name]
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 4 or shape[1:] != want or shape[0] < 1:
            raise ValueError(f"{name}: expected shape [num_pages, {', '.join(map(str, want))}]"
                             f", got {list(shape)}")
        got = np.dtype(x.dtype).name
        if got != values:
            hint = ("" if call.quantized or got not in QUANTIZED_KV_DTYPES else
                    f"; for a quantized cache get the paged attention with "
                    f"kv_dtype={got!r} and pass its scales")
            raise ValueError(f"{name}: expected dtype {values}, got {got}{hint}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages, v_pages: expected one shape, got {list(k_pages.shape)}"
                         f" and {list(v_pages.shape)}")
    if not call.quantized:
        for name in ("k_scales", "v_scales"):
            if given[name] is not None:
                raise ValueError(f"{name}: given, but this paged attention's cache is not "
                                 f"quantized (dtype {call.dtype}); get it with kv_dtype= "
                                 "to store values and scales")
        return k_pages, v_pages
    for name in ("k_scales", "v_scales"):
        x = given[name]
        if x is None:
            raise ValueError(f"{name}: missing; a {call.kv_dtype} cache needs K's and V's "
                             f"scales, float32 [num_pages, {call.page_size}, {call.kv_heads}]")
        _array(name, x, (int(k_pages.shape[0]), call.page_size, call.kv_heads), "float32",
               "a quantized cache's scales")
    return k_pages, v_pages, k_scales, v_scales
