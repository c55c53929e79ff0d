"""Ragged paged batches with garbage where the contract says it never matters: the
inputs of the paged probe (:mod:`.paged_run`), of the conformance suite's paged
family (``attn_backends_contracts.paged_cases`` re-exports them) and of the repo's
tests, so all three judge a backend on batches built one way.

NumPy only; a :class:`PagedCase` holds the canonical view (K and V ``[num_pages,
page_size, Hkv, D]``) and the batch's arrays, and :meth:`PagedCase.expected` is the
float64 oracle's answer on it (:func:`attn_backends.oracle.paged_attention`).
:func:`quantize_rows` and :func:`dequantize_rows` are the NumPy quantizer and its
exact inverse map (value * scale) that every quantized judgement reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract.paged_quantize import LARGEST
from .paged_oracle import paged_attention as oracle

#: What integer garbage is made of: an index no pool has.
BAD_INDEX = 2**30
#: What float garbage is made of, cycled over the elements: NaN and both infinities.
GARBAGE = (np.nan, np.inf, -np.inf)


def _garbage(shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``shape`` holding NaN, Inf and -Inf in turn."""
    size = int(np.prod(shape))
    return np.resize(np.asarray(GARBAGE, np.float32), size).reshape(shape)


@dataclass
class PagedCase:
    """One ragged batch over a canonical pool (NumPy): q ``[T, Hq, D]``, K and V
    ``[num_pages, page_size, Hkv, D]``, the batch's arrays, and ``slots`` with
    ``k_rows``/``v_rows``: every filled position's slot and its K and V."""

    q: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    num_seqs: int
    slots: np.ndarray
    k_rows: np.ndarray
    v_rows: np.ndarray
    #: A quantized case's K and V scales ``[num_pages, page_size, Hkv]`` (its
    #: ``k_pages``/``v_pages`` then hold the quantized values); None otherwise.
    k_scales: np.ndarray | None = None
    v_scales: np.ndarray | None = None

    def canonical(self) -> tuple[np.ndarray, ...]:
        """The canonical view's arrays, as ``from_canonical`` takes them: K and V,
        and a quantized case's scales."""
        scales = () if self.k_scales is None else (self.k_scales, self.v_scales)
        return (self.k_pages, self.v_pages, *scales)

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[num_pages, page_size, Hkv, D]`` in float64: a quantized case's
        values times their scales, exactly (docs/DESIGN.md, "Quantized caches")."""
        if self.k_scales is None:
            k, v = (np.asarray(x).astype(np.float64) for x in (self.k_pages, self.v_pages))
            return k, v
        # Garbage slots hold Inf scales times 0 values: NaN there, as intended.
        with np.errstate(invalid="ignore"):
            return (dequantize_rows(self.k_pages, self.k_scales),
                    dequantize_rows(self.v_pages, self.v_scales))

    @property
    def page_size(self) -> int:
        return int(self.k_pages.shape[1])

    def batch(self) -> Any:
        """The batch as an :class:`attn_backends.PagedBatch` of int32 jax arrays."""
        import jax.numpy as jnp

        from ..contract.paged import PagedBatch

        return PagedBatch(jnp.asarray(self.cu_q_lens), jnp.asarray(self.kv_lens),
                          jnp.asarray(self.page_table), jnp.int32(self.num_seqs))

    def new_token_slots(self) -> np.ndarray:
        """int32 ``[cu_q_lens[num_seqs]]``: the slot of each counted query row's own
        key (row j of sequence s sits at position ``kv_len - q_len + j``)."""
        out = []
        for s in range(self.num_seqs):
            q_len, kv_len = int(self.cu_q_lens[s + 1] - self.cu_q_lens[s]), int(self.kv_lens[s])
            for p in range(kv_len - q_len, kv_len):
                page = int(self.page_table[s, p // self.page_size])
                out.append(page * self.page_size + p % self.page_size)
        return np.asarray(out, np.int32)

    def expected(self, **call: Any) -> np.ndarray:
        """The float64 oracle's answer (``call``: scale, softcap, window) on the
        (dequantized) cache."""
        return oracle(self.q, *self.dequantized(), self.cu_q_lens, self.kv_lens,
                      self.page_table, self.num_seqs, **call)


def paged_case(seqs: Sequence[tuple[int, int]], *, page_size: int, hq: int = 4,
               hkv: int = 2, d: int = 8, num_seqs: int | None = None, order: str = "random",
               pad_rows: int = 0, extra_cols: int = 1, spare_pages: int = 2,
               garbage: bool = True, seed: int = 0,
               kv_dtype: str | None = None, cache_dtype: str | None = None) -> PagedCase:
    """A batch of sequences ``(q_len, kv_len)``; only the first ``num_seqs`` count
    (default all), the rest are uncounted table rows with garbage metadata.

    ``order``: pages handed out in a random permutation, in ``"reversed"`` order,
    or ``"shared"`` (every sequence reads sequence 0's pages: its prefix).
    With ``garbage``, everything the contract says never matters holds NaN, Inf
    and -Inf (or an impossible index): unreferenced pages, slots past
    ``kv_lens``, table entries past a sequence's last page, padding rows,
    uncounted sequences' metadata. Without it, zeros: the same case's
    zero-filled twin (the same seed draws the same values).

    ``kv_dtype`` (int8, float8_e4m3fn, float8_e5m2): the pages hold each
    filled position's K and V quantized (:func:`quantize_rows`) with their
    scales; with ``garbage``, unfilled positions hold arbitrary bytes (NaN and
    Inf where the dtype has them) and NaN, Inf and -Inf in their scale slots.
    ``cache_dtype``: its name before 0.2 (deprecated).
    """
    if cache_dtype is not None:
        from ..contract.errors import renamed

        renamed("paged_case(cache_dtype=)", "paged_case(kv_dtype=)")
        kv_dtype = cache_dtype if kv_dtype is None else kv_dtype
    rng = np.random.default_rng(seed)
    num_seqs = len(seqs) if num_seqs is None else num_seqs
    counted = list(seqs[:num_seqs])
    pages_of = [-(-kv // page_size) for _, kv in seqs]
    cols = max(pages_of + [1]) + extra_cols
    pool = sum(pages_of) + spare_pages
    free = {"random": rng.permutation(pool), "reversed": np.arange(pool)[::-1],
            "shared": np.arange(pool)}[order]
    bad = BAD_INDEX if garbage else 0
    table = np.full((len(seqs), cols), bad, np.int32)
    shape = (pool, page_size, hkv, d)
    k_pages = _garbage(shape) if garbage else np.zeros(shape, np.float32)
    v_pages = _garbage(shape)[::-1].copy() if garbage else np.zeros(shape, np.float32)
    slots, k_rows, v_rows = [], [], []
    used = 0
    for s, (_, kv) in enumerate(seqs):
        if order == "shared" and s:
            if kv > seqs[0][1]:
                raise ValueError("paged_case: with order='shared' a sequence reads sequence "
                                 f"0's prefix, so kv_len {kv} must be <= {seqs[0][1]}")
            table[s, : pages_of[s]] = table[0, : pages_of[s]]
            continue
        table[s, : pages_of[s]] = free[used: used + pages_of[s]]
        used += pages_of[s]
        for p in range(kv):
            slot = int(table[s, p // page_size]) * page_size + p % page_size
            k, v = rng.normal(size=(2, hkv, d)).astype(np.float32)
            k_pages[slot // page_size, slot % page_size] = k
            v_pages[slot // page_size, slot % page_size] = v
            slots.append(slot)
            k_rows.append(k)
            v_rows.append(v)
    q_lens = [q for q, _ in counted]
    cu = np.full(len(seqs) + 1, bad, np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)])
    if not garbage:
        cu[num_seqs + 1:] = cu[num_seqs]
    kv_lens = np.array([kv if s < num_seqs else bad for s, (_, kv) in enumerate(seqs)], np.int32)
    rows = int(cu[num_seqs]) + pad_rows
    q = rng.normal(size=(rows, hq, d)).astype(np.float32)
    start = int(cu[num_seqs])
    q[start:] = _garbage(q[start:].shape) if garbage else 0.0
    empty = np.zeros((0, hkv, d), np.float32)
    case = PagedCase(q, k_pages, v_pages, cu, kv_lens, table, num_seqs,
                     np.asarray(slots, np.int32), np.asarray(k_rows) if k_rows else empty,
                     np.asarray(v_rows) if v_rows else empty)
    return case if kv_dtype is None else _quantized(case, kv_dtype, garbage)


def quantize_rows(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """x ``[..., D]`` -> (values ``[..., D]`` in ``kv_dtype``, float32 scales
    ``[...]``) by the contract's rule, in NumPy: ``scale = max|x| / largest``;
    int8 values rounded half to even, float8 values rounded by the cast; a row
    of zeros stores scale 0. Finite rows only."""
    import ml_dtypes  # noqa: F401 - registers the float8 dtypes with NumPy

    x = np.asarray(x, np.float32)
    largest = np.float32(LARGEST[kv_dtype])
    scales = (np.max(np.abs(x), axis=-1) / largest).astype(np.float32)
    ratio = x / np.where(scales > 0, scales, np.float32(1))[..., None]
    ratio = np.clip(ratio, -largest, largest)
    if kv_dtype == "int8":
        ratio = np.rint(ratio)
    return ratio.astype(np.dtype(kv_dtype)), scales


def dequantize_rows(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float64 values ``[..., D]`` that quantized ``values`` ``[..., D]`` (int8,
    float8_e4m3fn or float8_e5m2) with float32 ``scales`` ``[...]`` (one per row:
    ``values.shape[:-1]``) stand for: ``value * scale``, in NumPy, exactly (every
    int8 or float8 value and every float32 scale is a float64, and so is their
    product), the K and V the oracle judges a quantized call on."""
    import ml_dtypes  # noqa: F401 - registers the float8 dtypes with NumPy

    values, scales = np.asarray(values), np.asarray(scales)
    if scales.shape != values.shape[:-1]:
        raise ValueError(f"dequantize_rows: scales must have shape values.shape[:-1] = "
                         f"{list(values.shape[:-1])}, got {list(scales.shape)}")
    return values.astype(np.float64) * scales.astype(np.float64)[..., None]


#: Mantissa bits of each float8 format: a value's spacing is ``2**(e - bits)``.
_MANTISSA = {"float8_e4m3fn": 3, "float8_e5m2": 2}


def half_step(values: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Half the distance from each stored value to its neighbours in ``kv_dtype``,
    in units of its scale, float64 like ``values``: 0.5 for int8; for float8 half
    the spacing at the value (the wider one, below a power of two), never below
    half the smallest subnormal step. An element is quantized right when it lies
    within ``half_step * scale`` of ``value * scale``."""
    if kv_dtype == "int8":
        return np.full(values.shape, 0.5)
    import ml_dtypes

    tiny = float(ml_dtypes.finfo(np.dtype(kv_dtype)).smallest_subnormal)
    bits = _MANTISSA[kv_dtype]
    return 0.5 * np.maximum(np.abs(values.astype(np.float64)) * 2.0 ** -bits, tiny)


def _quantized(case: PagedCase, kv_dtype: str, garbage: bool) -> PagedCase:
    """``case`` with its filled positions quantized and garbage (or zeros) elsewhere."""
    import ml_dtypes  # noqa: F401 - registers the float8 dtypes with NumPy

    dtype = np.dtype(kv_dtype)
    shape = case.k_pages.shape
    flat = shape[0] * shape[1]
    arrays = []
    for pages, rows, flip in ((case.k_pages, case.k_rows, False),
                              (case.v_pages, case.v_rows, True)):
        if garbage:
            # Every byte value in turn (for float8: NaN and +-Inf among them).
            values = np.resize(np.arange(256, dtype=np.uint8), pages.size).view(dtype)
            values = values.reshape(shape)
            scales = _garbage(shape[:3])
            if flip:
                values, scales = values[::-1].copy(), scales[::-1].copy()
        else:
            values, scales = np.zeros(shape, dtype), np.zeros(shape[:3], np.float32)
        q, s = quantize_rows(rows, kv_dtype)
        values.reshape(flat, *shape[2:])[case.slots] = q
        scales.reshape(flat, shape[2])[case.slots] = s
        arrays += [values, scales]
    return dataclasses.replace(case, k_pages=arrays[0], v_pages=arrays[2], k_scales=arrays[1],
                               v_scales=arrays[3])
