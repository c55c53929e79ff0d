"""Helpers for paged-attention tests: ragged batches with garbage where the contract
says it never matters, and fake paged backends (no plugin imports)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
from _support import ALL_FEATURES
from attn_backends import Backend, Capabilities, KVCache, PagedBackend, PagedCapabilities
from attn_backends.authoring import canonical_write
from attn_backends.oracle import paged_attention as oracle

#: What the garbage is made of: NaN in floats, an index no pool has in ints.
BAD_INDEX = 2**30


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

    def batch(self) -> ab.PagedBatch:
        return ab.PagedBatch(jnp.asarray(self.cu_q_lens), jnp.asarray(self.kv_lens),
                             jnp.asarray(self.page_table), jnp.int32(self.num_seqs))

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
    With ``garbage``, everything the contract says never matters holds NaN (or
    an impossible index): unreferenced pages, slots past ``kv_lens``, table
    entries past a sequence's last page, padding rows, uncounted sequences'
    metadata. Without it, zeros: the same case's zero-filled twin.
    """
    rng = np.random.default_rng(seed)
    num_seqs = len(seqs) if num_seqs is None else num_seqs
    counted = list(seqs[:num_seqs])
    pages_of = [-(-kv // page_size) for _, kv in seqs]
    cols = max(pages_of + [1]) + extra_cols
    pool = sum(pages_of) + spare_pages
    free = {"random": rng.permutation(pool), "reversed": np.arange(pool)[::-1],
            "shared": np.arange(pool)}[order]
    fill = np.nan if garbage else 0.0
    bad = BAD_INDEX if garbage else 0
    table = np.full((len(seqs), cols), bad, np.int32)
    k_pages = np.full((pool, page_size, hkv, d), fill, np.float32)
    v_pages = np.full_like(k_pages, fill)
    slots, k_rows, v_rows = [], [], []
    used = 0
    for s, (_, kv) in enumerate(seqs):
        if order == "shared" and s:
            assert kv <= seqs[0][1], "shared pages: a sequence reads sequence 0's prefix"
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
    q[int(cu[num_seqs]):] = fill
    empty = np.zeros((0, hkv, d), np.float32)
    return PagedCase(q, k_pages, v_pages, cu, kv_lens, table, num_seqs,
                     np.asarray(slots, np.int32), np.asarray(k_rows) if k_rows else empty,
                     np.asarray(v_rows) if v_rows else empty)


def _oracle_attend(call: ab.PagedCall, q: Any, k_pages: Any, v_pages: Any,
                   batch: ab.PagedBatch) -> Any:
    """The float64 oracle run as a host callback: a fake that computes, with no
    code of its own to trust."""

    def host(q: Any, k: Any, v: Any, cu: Any, kv: Any, table: Any, num: Any) -> np.ndarray:
        return oracle(q, k, v, cu, kv, table, num, scale=call.scale, softcap=call.softcap,
                      window=call.window).astype(q.dtype)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), q, k_pages,
                             v_pages, *batch)


def make_paged_backend(name: str, *, priority: int = 10, layout: str = ab.CANONICAL_LAYOUT,
                       platforms: tuple[str, ...] = ("cpu", "gpu", "tpu"),
                       check_paged: Callable[[ab.PagedCall], list[str]] | None = None,
                       **paged: Any) -> Backend:
    """A dense fake that also serves paged calls, through the oracle. ``layout``
    ``"heads_first"`` keeps K and V ``[Hkv, num_pages, page_size, D]``, so the
    canonical view is a real conversion."""
    claims = {"gqa": True, "softcap": True, "window": True, **paged}

    class FakePaged(Backend, PagedBackend):
        version = "9.9"
        capabilities = Capabilities(platforms=frozenset(platforms), **ALL_FEATURES)
        paged_capabilities = PagedCapabilities(platforms=frozenset(platforms), **claims)

        def attend(self, call, q, k, v, operands, options=None):  # type: ignore[no-untyped-def]
            raise AssertionError("the paged fakes serve paged calls only")

        def check_paged(self, call: ab.PagedCall) -> list[str]:
            return check_paged(call) if check_paged else []

        def cache_layout(self, call: ab.PagedCall) -> str:
            return layout

        def from_canonical(self, call: ab.PagedCall, k_pages: Any, v_pages: Any) -> KVCache:
            if layout == ab.CANONICAL_LAYOUT:
                return super().from_canonical(call, k_pages, v_pages)
            arrays = tuple(jnp.transpose(x, (2, 0, 1, 3)) for x in (k_pages, v_pages))
            return KVCache(arrays, layout, call.page_size, k_pages.shape[0])

        def to_canonical(self, call: ab.PagedCall, cache: KVCache) -> tuple[Any, Any]:
            if layout == ab.CANONICAL_LAYOUT:
                return super().to_canonical(call, cache)
            k, v = (jnp.transpose(x, (1, 2, 0, 3)) for x in cache.arrays)
            return k, v

        def write(self, call: ab.PagedCall, cache: KVCache, k: Any, v: Any,
                  slots: Any) -> KVCache:
            if layout == ab.CANONICAL_LAYOUT:
                return super().write(call, cache, k, v, slots)
            pages = canonical_write(call, *self.to_canonical(call, cache), k, v, slots)
            return self.from_canonical(call, *pages)

        def attend_paged(self, call, q, cache, batch, options=None):  # type: ignore[no-untyped-def]
            k, v = self.to_canonical(call, cache)
            return _oracle_attend(call, q, k, v, batch)

    FakePaged.name = name
    FakePaged.priority = {p: priority for p in ("cpu", "gpu", "tpu")}
    return FakePaged()
