"""Ragged paged batches with garbage where the contract says it never matters: the
inputs of the paged probe (:mod:`.paged_run`), of the conformance suite's paged
family (``attn_backends_contracts.paged_cases`` re-exports them) and of the repo's
tests, so all three judge a backend on batches built one way.

NumPy only; a :class:`PagedCase` holds the canonical view (K and V ``[num_pages,
page_size, Hkv, D]``) and the batch's arrays, and :meth:`PagedCase.expected` is the
float64 oracle's answer on it (:func:`attn_backends.oracle.paged_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
        """The float64 oracle's answer (``call``: scale, softcap, window)."""
        return oracle(self.q, self.k_pages, self.v_pages, self.cu_q_lens, self.kv_lens,
                      self.page_table, self.num_seqs, **call)


def paged_case(seqs: Sequence[tuple[int, int]], *, page_size: int, hq: int = 4,
               hkv: int = 2, d: int = 8, num_seqs: int | None = None, order: str = "random",
               pad_rows: int = 0, extra_cols: int = 1, spare_pages: int = 2,
               garbage: bool = True, seed: int = 0) -> PagedCase:
    """A batch of sequences ``(q_len, kv_len)``; only the first ``num_seqs`` count
    (default all), the rest are uncounted table rows with garbage metadata.

    ``order``: pages handed out in a random permutation, in ``"reversed"`` order,
    or ``"shared"`` (every sequence reads sequence 0's pages: its prefix).
    With ``garbage``, everything the contract says never matters holds NaN, Inf
    and -Inf (or an impossible index): unreferenced pages, slots past
    ``kv_lens``, table entries past a sequence's last page, padding rows,
    uncounted sequences' metadata. Without it, zeros: the same case's
    zero-filled twin (the same seed draws the same values).
    """
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
    return PagedCase(q, k_pages, v_pages, cu, kv_lens, table, num_seqs,
                     np.asarray(slots, np.int32), np.asarray(k_rows) if k_rows else empty,
                     np.asarray(v_rows) if v_rows else empty)
