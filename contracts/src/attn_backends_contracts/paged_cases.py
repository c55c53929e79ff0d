"""The ``paged`` family's cases, built from a backend's paged manifest, and the
ragged-batch generator they use.

:func:`paged_case` and :class:`PagedCase` are core's
(:mod:`attn_backends.oracle`): the runtime paged probe builds its batch with the
same generator, as the dense probe and suite share one oracle. A user certifying
a backend, or writing its own tests, imports them from here.

Lengths are chosen around the page size the case runs at (the smallest one the
manifest claims, else :data:`DEFAULT_PAGE_SIZE`): a key length of 1,
``page_size - 1``, ``page_size``, ``page_size + 1`` and several pages, each as a
pure prefill, a chunked prefill and a decode step. Pages in random and reversed
order and shared between sequences; all kinds of sequence in one batch in two
orders, with uncounted table rows, sequences with no new tokens and padding
rows; GQA groups 1, 2, 4 and 8 and MQA; softcap with a scale; windows; pure
decode steps under ``max_q_len=1``, with an uncounted table row and with every
row counted; the same sequence at two batch positions.
Everything the contract says never matters holds NaN, Inf and -Inf. Other
claimed dtypes, page sizes and head dims each run a few of these.

A backend whose manifest serves only some calls on the suite's platform (by
its own ``unmet``: an emulated kernel that runs only for decode steps, say)
gets each case it declines as that case's decode step, in the first claimed
dtype it serves (:func:`as_served`), rather than the case skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from attn_backends.authoring import CLAIMABLE_DTYPES, PAGED_FEATURES, QUANTIZED_KV_DTYPES
from attn_backends.oracle import PagedCase, paged_case

from ._paged_case import PagedSuiteCase
from .cases import HEAD_DIM_CANDIDATES, base_head_dim

__all__ = ["DEFAULT_PAGE_SIZE", "PagedCase", "PagedSuiteCase", "as_served", "emulated",
           "not_applicable", "paged_case", "paged_cases_for", "paged_dtypes", "paged_unclaimed",
           "unclaimed_case"]

#: The page size of a manifest that takes any: small, so a few tokens cross pages.
DEFAULT_PAGE_SIZE = 4
#: Cases repeated in every claimed dtype besides the primary one (by name).
DTYPE_SWEEP = ("mixed", "gqa-h8kv2", "window-p")
#: Cases run at the manifest's other page sizes and head dims (by name).
SHAPE_SWEEP = ("mixed",)
#: Cases the ``quantized`` family runs, in the primary dtype (by name): all of
#: them for the first claimed cache dtype (int8 when claimed), the first two for
#: each other one (the same path, another element type) and in quick runs; and
#: the first in bfloat16 when claimed.
QUANTIZED_SWEEP = ("mixed", "decode-max-q-len-1", "gqa-h8kv2", "window-p", "softcap-scale",
                   "same-seq-twice")
#: Kinds of case :func:`as_served` may run as a decode step (a ``same_seq``
#: case's rows are laid out for sequences of two new rows).
AS_DECODE_KINDS = ("attend", "store")


def not_applicable(backend: Any, platform: str) -> str | None:
    """Why the family does not apply to ``backend`` on ``platform`` (None: it does)."""
    from attn_backends.authoring import PagedBackend

    if not isinstance(backend, PagedBackend):
        return (f"backend {backend.name!r} has no paged support (it does not implement "
                "attn_backends.PagedBackend)")
    platforms = backend.paged_capabilities.platforms
    if platform not in platforms:
        return (f"backend {backend.name!r}'s paged support does not claim platform "
                f"{platform!r} (it claims {sorted(platforms)})")
    return None


def _primary(dtypes: frozenset[str]) -> str:
    return "float32" if "float32" in dtypes else sorted(dtypes)[0]


def _table(p: int) -> list[PagedSuiteCase]:
    """The primary-dtype cases at page size ``p`` (every feature; filtered later)."""
    c = PagedSuiteCase
    out = []
    for kv in sorted({1, p - 1, p, p + 1, 3 * p + 2} - {0}):
        # A pure prefill, a chunked prefill and a decode step of the same length.
        out.append(c(f"kv{kv}", seqs=((kv, kv), (max(1, kv // 2), kv), (1, kv)),
                     quick=kv == p + 1))
    for order in ("random", "reversed", "shared"):
        out.append(c(f"pages-{order}", seqs=((3, 2 * p + 3), (1, p + 3), (2, 2 * p + 3)),
                     order=order, spare_pages=3, quick=order == "shared"))
    # prefill, decode, no new tokens, chunk, decode; two uncounted table rows.
    out.append(c("mixed", seqs=((p + 2, p + 2), (1, 2 * p + 1), (0, 5), (3, 2 * p + 2),
                                (1, 1), (4, 4), (2, 8)),
                 num_seqs=5, pad_rows=3, extra_cols=2, quick=True))
    out.append(c("mixed-decode-first", seqs=((1, 3 * p), (2, p + 1), (0, p), (p, p), (1, 2)),
                 num_seqs=4, pad_rows=2))
    out.append(c("none-counted", seqs=((2, 3), (1, 4)), num_seqs=0, pad_rows=4))
    for hq, hkv in ((2, 2), (4, 2), (8, 2), (16, 2), (4, 1)):
        name = f"gqa-h{hq}kv{hkv}" + ("-mqa" if hkv == 1 else "")
        out.append(c(name, seqs=((3, p + 3), (1, 2 * p + 2)), q_heads=hq, kv_heads=hkv,
                     quick=(hq, hkv) == (8, 2)))
    out.append(c("softcap-scale", seqs=((5, 3 * p + 1), (1, p + 2)), softcap=2.0, scale=0.9,
                 quick=True))
    windows = {"0": 0, "1": 1, "p": p, "2p+1": 2 * p + 1}
    for label, left in windows.items():
        out.append(c(f"window-{label}", seqs=((5, 3 * p + 1), (1, 3 * p), (p + 1, p + 1),
                                             (1, 7 * p + 2)),
                     window_left=left, quick=label == "p"))
    out.append(c("decode-max-q-len-1", seqs=((1, 1), (1, p), (1, 3 * p + 1), (1, p + 1)),
                 num_seqs=3, pad_rows=2, max_q_len=1))
    # Every table row counted, padding rows after them: a backend that places
    # each sequence's rows in slots of its own must not give a padding row the
    # last sequence's (the case above leaves its last table row uncounted).
    out.append(c("decode-every-seq-counted", seqs=((1, p), (1, 2 * p + 1)), pad_rows=3,
                 max_q_len=1))
    out.append(c("same-seq-twice", kind="same_seq", seqs=((2, 2 * p + 1), (1, 3), (2, 2 * p + 1)),
                 order="shared", pad_rows=0, quick=True))
    return out


def _claimed(case: PagedSuiteCase, pcaps: Any) -> bool:
    """The manifest claims every feature ``case`` uses."""
    if case.q_heads != case.kv_heads and not pcaps.gqa:
        return False
    if case.softcap is not None and not pcaps.softcap:
        return False
    return case.window_left is None or pcaps.window


def _within(case: PagedSuiteCase, pcaps: Any) -> PagedSuiteCase:
    """``case`` for a manifest serving at most ``max_q_len`` rows per sequence: each
    sequence's new rows cut to that many, the call promising it."""
    cap = pcaps.max_q_len
    if cap is None:
        return case
    seqs = tuple((min(q, cap), kv) for q, kv in case.seqs)
    return replace(case, seqs=seqs, max_q_len=min(case.max_q_len or cap, cap))


def _other_head_dims(head_dims: Any, base: int) -> list[int]:
    pool = sorted(head_dims.allowed) if head_dims.allowed is not None else HEAD_DIM_CANDIDATES
    return [d for d in pool if d != base and not head_dims.reasons(d, "head_dim")][:2]


def emulated(backend: Any, platform: str) -> bool:
    """Whether ``backend`` runs emulated here: its manifest says it can run in
    interpret mode and the suite runs on cpu (Pallas kernels interpreted)."""
    return bool(backend.capabilities.interpret) and platform == "cpu"


def paged_cases_for(backend: Any, *, quick: bool = False) -> list[PagedSuiteCase]:
    """The ``attend`` and ``same_seq`` cases ``backend``'s paged manifest can serve.

    The primary dtype (float32 if claimed) runs the whole table at the smallest
    claimed page size (:data:`DEFAULT_PAGE_SIZE` when any is taken) and the
    base head dim; each other claimed dtype runs :data:`DTYPE_SWEEP` (float64
    under ``jax.enable_x64``); up to two other claimed page sizes and head dims
    run :data:`SHAPE_SWEEP`. A manifest serving at most ``max_q_len`` rows per
    sequence gets every case cut to that. ``quick`` (``--attn-quick``, and every
    run of an :func:`emulated` backend, whose kernels run interpreted, slowly):
    the cases marked so, one per other dtype, one other page size and head dim.
    The claimed quantized cache dtypes run :data:`QUANTIZED_SWEEP` (the
    ``quantized`` family), garbage in its unused values and scale slots too.
    """
    pcaps = backend.paged_capabilities
    sizes = sorted(pcaps.page_sizes) if pcaps.page_sizes is not None else [DEFAULT_PAGE_SIZE]
    p, d = sizes[0], base_head_dim(pcaps.head_dims)
    primary = _primary(pcaps.dtypes)
    table = [replace(c, page_size=p, head_dim=d, dtype=primary) for c in _table(p)]
    table = [_within(c, pcaps) for c in table if _claimed(c, pcaps)]
    if quick:
        table = [c for c in table if c.quick]
    by_name = {c.name: c for c in table}
    out = list(table)
    for dtype in sorted(pcaps.dtypes - {primary}):
        out += [replace(by_name[n], dtype=dtype) for n in DTYPE_SWEEP if n in by_name][
            : 1 if quick else None]
    for name in SHAPE_SWEEP:
        if name not in by_name:
            continue
        case = by_name[name]
        for size in sizes[1:2 if quick else 3]:
            # The case's lengths were drawn around the smallest page size; at a
            # larger one they are redrawn around it.
            grown = next(c for c in _table(size) if c.name == name)
            out.append(_within(replace(grown, name=f"{name}-page{size}", page_size=size,
                                       head_dim=d, dtype=primary), pcaps))
        for dim in _other_head_dims(pcaps.head_dims, d)[: 1 if quick else 2]:
            out.append(replace(case, name=f"{name}-d{dim}", head_dim=dim))
    full = {c.name: _within(c, pcaps) for c in
            (replace(c, page_size=p, head_dim=d, dtype=primary) for c in _table(p))
            if _claimed(c, pcaps)}
    sweep = [full[n] for n in QUANTIZED_SWEEP if n in full]
    ordered = sorted(pcaps.kv_dtypes, key=lambda dt: (dt != "int8", dt))
    for i, kv_dtype in enumerate(ordered):
        out += [replace(c, kv_dtype=kv_dtype) for c in sweep[: 2 if quick or i else None]]
        if "bfloat16" in pcaps.dtypes - {primary} and sweep:
            out.append(replace(sweep[0], kv_dtype=kv_dtype, dtype="bfloat16"))
    return out


def as_served(cases: list[PagedSuiteCase], backend: Any, platform: str,
              call_of: Callable[[PagedSuiteCase], Any]) -> list[PagedSuiteCase]:
    """``cases`` as ``backend`` serves them on ``platform``, by its manifest's ``unmet``.

    A case the manifest declines there is replaced by its decode step: every
    sequence's new rows cut to at most one (a sequence with none keeps none;
    key lengths, pages, garbage and padding rows as before), under
    ``max_q_len=1``, in the case's dtype or else the first other claimed dtype
    the manifest serves (the id says ``-as-decode`` and names that dtype). A
    case with no such step stays as it is, and its test skips with the
    manifest's reasons. Duplicates (two cases with one step) run once.
    ``call_of(case)`` is the case's :class:`attn_backends.PagedCall`.
    """
    pcaps = backend.paged_capabilities

    def served(case: PagedSuiteCase) -> bool:
        return not pcaps.unmet(call_of(case), platform)

    out: list[PagedSuiteCase] = []
    for case in cases:
        if case.kind in AS_DECODE_KINDS and not served(case):
            step = replace(case, name=f"{case.name}-as-decode", max_q_len=1,
                           seqs=tuple((min(q, 1), kv) for q, kv in case.seqs))
            dtypes = [case.dtype, *sorted(pcaps.dtypes - {case.dtype})]
            case = next((c for c in (replace(step, dtype=dt) for dt in dtypes) if served(c)),
                        case)
        if case.id not in {c.id for c in out}:
            out.append(case)
    return out


def paged_dtypes(backend: Any) -> list[PagedSuiteCase]:
    """One ``store`` case (write and the canonical round trip) per claimed dtype, and
    one per claimed quantized cache dtype (in the primary dtype)."""
    pcaps = backend.paged_capabilities
    p = min(pcaps.page_sizes) if pcaps.page_sizes is not None else DEFAULT_PAGE_SIZE
    d = base_head_dim(pcaps.head_dims)
    store = PagedSuiteCase("store", kind="store", seqs=((3, 2 * p - 1), (1, 2 * p + 1)),
                           page_size=p, head_dim=d, quick=True)
    return ([replace(store, dtype=dtype) for dtype in sorted(pcaps.dtypes)]
            + [replace(store, dtype=_primary(pcaps.dtypes), kv_dtype=kv_dtype)
               for kv_dtype in sorted(pcaps.kv_dtypes)])


def paged_unclaimed(backend: Any) -> list[tuple[str, str]]:
    """(kind, value) the paged manifest does not claim, each of which ``get_paged``
    must refuse: features, dtypes, a page size, a head dim, a ``max_q_len`` past
    the manifest's, a quantized cache dtype; and ("gradient", "q") always (paged
    attention has none)."""

    pcaps = backend.paged_capabilities
    out = [("feature", f) for f in PAGED_FEATURES if f not in pcaps.features]
    out += [("dtype", dt) for dt in sorted(CLAIMABLE_DTYPES - pcaps.dtypes)]
    if pcaps.page_sizes is not None:
        out.append(("page_size", str(next(n for n in range(1, 10**6)
                                          if n not in pcaps.page_sizes))))
    rejected = next((n for n in range(1, 4097) if pcaps.head_dims.reasons(n, "d")), None)
    if rejected is not None:
        out.append(("head_dim", str(rejected)))
    if pcaps.max_q_len is not None:
        out.append(("max_q_len", str(pcaps.max_q_len + 1)))
    out += [("kv_dtype", dt) for dt in QUANTIZED_KV_DTYPES
            if dt not in pcaps.kv_dtypes]
    out.append(("gradient", "q"))
    return out


def unclaimed_case(backend: Any, kind: str, value: str) -> PagedSuiteCase:
    """A small call of ``backend``'s paged manifest that uses the unclaimed ``value``."""
    pcaps = backend.paged_capabilities
    p = min(pcaps.page_sizes) if pcaps.page_sizes is not None else DEFAULT_PAGE_SIZE
    base = PagedSuiteCase(f"unclaimed-{kind}-{value}", seqs=((2, p + 1), (1, 3)), page_size=p,
                          head_dim=base_head_dim(pcaps.head_dims),
                          dtype=_primary(pcaps.dtypes), max_q_len=pcaps.max_q_len,
                          kv_heads=4 if not pcaps.gqa else 2)
    if kind == "feature":
        extra = {"gqa": {"kv_heads": 2}, "softcap": {"softcap": 5.0},
                 "window": {"window_left": 2}}[value]
        return replace(base, **extra)
    if kind == "dtype":
        return replace(base, dtype=value)
    if kind == "kv_dtype":
        return replace(base, kv_dtype=value)
    if kind in ("page_size", "head_dim", "max_q_len"):
        return replace(base, **{kind: int(value)})
    return base
