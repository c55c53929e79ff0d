"""One case of the suite's ``paged`` family (:class:`PagedSuiteCase`).

Imports nothing heavy, so the pytest plugin can recognise the family's cases
without importing JAX; the table is in :mod:`.paged_cases`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PagedSuiteCase:
    """One paged call and ragged batch of the ``paged`` family.

    ``kind``: "attend" (the backend on the batch with garbage equals its
    zero-filled twin bitwise and the float64 oracle within the tolerance
    table; padding rows are zeros), "same_seq" (also: the sequence at rows 0-1
    and 3-4 gives bitwise the same rows) or "store" (write and the canonical
    round trip, exact, in ``dtype``). ``seqs``: ``(q_len, kv_len)`` per table
    row, the first ``num_seqs`` counted (None: all); ``order``, ``pad_rows``,
    ``extra_cols``, ``spare_pages`` as in
    :func:`attn_backends.oracle.paged_case`. The call: ``q_heads``,
    ``kv_heads``, ``head_dim``, ``page_size``, ``dtype``, ``scale``,
    ``softcap``, ``window=(window_left, None)``, ``max_q_len``, ``kv_dtype``
    (a quantized cache: the ``quantized`` family, whose ``store`` cases check
    the quantizer's rule instead of bitwise writes).
    """

    name: str
    kind: str = "attend"
    seqs: tuple[tuple[int, int], ...] = ()
    dtype: str = "float32"
    page_size: int = 4
    head_dim: int = 16
    q_heads: int = 4
    kv_heads: int = 2
    num_seqs: int | None = None
    order: str = "random"
    pad_rows: int = 1
    extra_cols: int = 1
    spare_pages: int = 2
    scale: float | None = None
    softcap: float | None = None
    window_left: int | None = None
    max_q_len: int | None = None
    quick: bool = False
    #: A quantized cache's dtype (the ``quantized`` family), or None.
    kv_dtype: str | None = None

    @property
    def family(self) -> str:
        return "paged" if self.kv_dtype is None else "quantized"

    @property
    def id(self) -> str:
        stored = "" if self.kv_dtype is None else f"-{self.kv_dtype}"
        return f"{self.family}-{self.name}-{self.dtype}{stored}"

    @property
    def window(self) -> tuple[int, None] | None:
        return None if self.window_left is None else (self.window_left, None)

    def call_args(self) -> dict[str, object]:
        """``registry.get_paged``'s call keywords for this case."""
        return dict(num_q_heads=self.q_heads, num_kv_heads=self.kv_heads,
                    head_dim=self.head_dim, page_size=self.page_size, dtype=self.dtype,
                    scale=self.scale, softcap=self.softcap, window=self.window,
                    max_q_len=self.max_q_len, kv_dtype=self.kv_dtype)
