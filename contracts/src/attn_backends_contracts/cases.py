"""Named case tables: the shapes and features the conformance suite runs.

Each table is a tuple of :class:`Case` for one *family* (what the cases are
about: ``causal``, ``gqa``, ``masked_rows``, ...). :func:`cases_for` picks the
cases a backend's manifest can serve (features, dtypes, head dims) and fills
in the head dim, so the suite, benchmarks and autotuners share one table.
Lengths are small on purpose (compile time dominates on CPU) but include 1,
primes, ``Tq != Tk`` both ways and lengths that are not multiples of 16 or
128 (block sizes); the ``long`` family (full run only) has a few prime
lengths over 1,000. ``quick=True`` cases form the reduced table of
``--attn-quick``.

Small cases alone never reach the seams between a tiled kernel's tiles, where
its worst bugs live (an online-softmax rescale dropped, a gradient overwritten
instead of summed across blocks). So every primary-dtype case also runs as a
``tiles`` twin (``Case.tiles``, id suffix ``-tiles``) under the options the
backend's ``Backend.tile_small_options(call)`` declares, which cut even 17
tokens into several tiles; a backend that declares none (returns None) runs
no twins.

:func:`make_inputs` builds the arrays of a case deterministically from its
name: q, k, v in the case's dtype and their float64 values (what the oracle
sees), the optional operands, and the cotangents for the gradient check.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from attn_backends.authoring import QUANTIZED_KV_DTYPES

# Re-exported: a case, the garbage value and the arrays of a case, beside the tables.
from ._case import GARBAGE as GARBAGE
from ._case import Case
from ._inputs import WIDE_DTYPES as _WIDE_DTYPES
from ._inputs import make_inputs as make_inputs


def _c(family: str, name: str, **kw: Any) -> Case:
    return Case(name=name, family=family, **kw)


SHAPES = (
    _c("shapes", "q17k17", quick=True),
    _c("shapes", "q16k32b2", batch=2, q_len=16, kv_len=32, quick=True),
    _c("shapes", "q1k1", q_len=1, kv_len=1),
    _c("shapes", "q1k37", q_len=1, kv_len=37),
    _c("shapes", "q37k1", q_len=37, kv_len=1),
    _c("shapes", "q13k29", q_len=13, kv_len=29),
    _c("shapes", "q29k13", q_len=29, kv_len=13),
    _c("shapes", "scale0.3", scale=0.3),
)
BLOCKS = (
    _c("blocks", "q129k129", q_len=129, kv_len=129, q_heads=1, kv_heads=1),
    _c("blocks", "q130k257", q_len=130, kv_len=257, q_heads=1, kv_heads=1, causal=True),
    _c("blocks", "q257k130", q_len=257, kv_len=130, q_heads=1, kv_heads=1),
)
GQA = (
    _c("gqa", "h4kv2", q_heads=4, kv_heads=2, quick=True),
    _c("gqa", "h8kv2", q_heads=8, kv_heads=2, q_len=11, kv_len=13),
    _c("gqa", "h4kv1-mqa", q_heads=4, kv_heads=1),
    _c("gqa", "h6kv3", q_heads=6, kv_heads=3, q_len=7, kv_len=7),
)
CAUSAL = (
    _c("causal", "q17k17", causal=True, quick=True),
    _c("causal", "q7k19", q_len=7, kv_len=19, causal=True, quick=True),
    _c("causal", "q19k7", q_len=19, kv_len=7, causal=True),
    _c("causal", "q1k23", q_len=1, kv_len=23, causal=True),
    _c("causal", "q16k32", q_len=16, kv_len=32, causal=True),
)
WINDOW = (
    _c("window", "w3-1", window=(3, 1), quick=True),
    _c("window", "w2-0-q7k19", window=(2, 0), q_len=7, kv_len=19),
    _c("window", "wNone-0", window=(None, 0)),
    _c("window", "w4-None-q19k11", window=(4, None), q_len=19, kv_len=11),
    _c("window", "w0-0", window=(0, 0)),
)
SEGMENT_IDS = (
    _c("segment_ids", "packed-b2", batch=2, segments="packed", quick=True),
    _c("segment_ids", "packed-q13k29", q_len=13, kv_len=29, segments="packed"),
)
LENGTHS = (
    _c("lengths", "kv-b3", batch=3, kv_lengths=(17, 9, 1), quick=True),
    _c("lengths", "q-and-kv-b2", batch=2, q_lengths=(5, 17), kv_lengths=(11, 17)),
    _c("lengths", "garbage-b2", batch=2, kv_lengths=(6, 13), inputs="garbage"),
)
MASK = (
    _c("mask", "full", mask="full", quick=True),
    _c("mask", "shared", mask="shared", q_len=11, kv_len=23),
    _c("mask", "per-batch", batch=2, mask="per_batch"),
    _c("mask", "per-head", mask="per_head", q_heads=4, kv_heads=4),
)
BIAS = (
    _c("bias", "full", bias="full", quick=True),
    _c("bias", "shared", bias="shared", q_len=11, kv_len=23),
    _c("bias", "per-head", bias="per_head", batch=2),
    _c("bias", "per-batch-f32", batch=2, bias="per_batch", bias_dtype="float32"),
)
SOFTCAP = (
    _c("softcap", "c5", softcap=5.0, quick=True),
    _c("softcap", "c2-q11k23", softcap=2.0, q_len=11, kv_len=23),
)
RETURN_LSE = (
    _c("return_lse", "q17k17", return_lse=True),
    _c("return_lse", "q7k19", return_lse=True, q_len=7, kv_len=19),
)
COMBINED = (
    _c("combined", "softcap+bias", softcap=5.0, bias="full", quick=True),
    _c("combined", "causal+segments", causal=True, segments="packed", batch=2),
    _c("combined", "window+mask", window=(5, 2), mask="full", q_len=11, kv_len=19),
    _c("combined", "causal+window", causal=True, window=(4, None), q_len=19, kv_len=19),
    _c("combined", "causal+lengths+gqa", causal=True, batch=2, q_heads=4, kv_heads=2,
       q_len=9, kv_len=15, q_lengths=(9, 4), kv_lengths=(15, 10)),
    _c("combined", "all", batch=2, q_heads=4, kv_heads=2, q_len=11, kv_len=19, causal=True,
       window=(8, None), segments="packed", kv_lengths=(19, 14), mask="per_head",
       bias="full", softcap=5.0, return_lse=True, quick=True),
)
MASKED_ROWS = (
    _c("masked_rows", "causal-q23k5", q_len=23, kv_len=5, causal=True, lse=True, quick=True),
    _c("masked_rows", "kv-len0-b2", batch=2, kv_lengths=(0, 9), lse=True, quick=True),
    _c("masked_rows", "q-len-short-b2", batch=2, q_lengths=(3, 0), lse=True),
    _c("masked_rows", "disjoint-segments", segments="disjoint", lse=True),
    _c("masked_rows", "mask-empty-rows", mask="empty_rows", lse=True),
    _c("masked_rows", "window-past-length", q_len=5, kv_len=19, window=(0, 0),
       kv_lengths=(10,), lse=True),
)
# Key masks [B|1, 1, 1, Tk] (a padding mask, a decode cache's filled part): a
# backend claiming mask gets them broadcast to [B|1, 1, Tq, Tk], one claiming
# segment ids but not mask gets them as segment ids (combined with the call's
# own) through the registry's rewrite, so these cases certify that rewrite too.
# Examples that see no key, segment ids, causal, GQA, and a decode step against
# a cache spanning several kv blocks (300 keys: three blocks of 128).
KEY_MASK = (
    _c("key_mask", "b2", batch=2, mask="key", quick=True),
    _c("key_mask", "empty-example-b3", batch=3, mask="key_empty", lse=True, quick=True),
    _c("key_mask", "shared-causal-q13k29", q_len=13, kv_len=29, mask="key_shared",
       causal=True),
    _c("key_mask", "segments-empty-b3", batch=3, mask="key_empty", segments="packed",
       lse=True, quick=True),
    _c("key_mask", "gqa-lengths-q9k21-b2", batch=2, q_len=9, kv_len=21, q_heads=4, kv_heads=2,
       mask="key", kv_lengths=(21, 8)),
    _c("key_mask", "q130k300-b2", batch=2, q_len=130, kv_len=300, q_heads=1, kv_heads=1,
       mask="key_empty", causal=True, lse=True),
    _c("key_mask", "decode-q1k300-b2", batch=2, q_len=1, kv_len=300, q_heads=4, kv_heads=2,
       head_dim=128, mask="key_empty"),
)
MAGNITUDE = (
    _c("magnitude", "large", inputs="large", lse=True, quick=True),
    _c("magnitude", "large-causal-q7k19", inputs="large", causal=True, q_len=7, kv_len=19),
    _c("magnitude", "equal", inputs="equal", lse=True),
)
# Large same-sign logits, from a peer's suite (tokamax's test_small_sequences):
# q, k, v uniform in [1, 2) at head dim 64 give logits of 15 to 20 (at the
# base head dim where 64 is not claimed, smaller), so float32 holds each logit
# to its ulp at 16, 2**-19, instead of 2**-23 near 1 as standard normal inputs
# do; the weights spread over many keys and out, dv sit far from 0. The peer's
# shapes (256 queries against 8 keys and back, batch 2, 4 heads; 8 queries
# reach xla_native's decode path), then causal GQA over 300 queries and keys
# (several default blocks of the tiled kernels' forward, Tq == Tk for kernels
# that serve only that); the tiles twins cut each into many tiles.
SAME_SIGN = (
    _c("same_sign", "q256k8-b2", batch=2, q_len=256, kv_len=8, q_heads=4, kv_heads=4,
       head_dim=64, inputs="positive", lse=True, quick=True),
    _c("same_sign", "q8k256-b2", batch=2, q_len=8, kv_len=256, q_heads=4, kv_heads=4,
       head_dim=64, inputs="positive"),
    _c("same_sign", "causal-gqa-q300k300", q_len=300, kv_len=300, q_heads=2, kv_heads=1,
       head_dim=64, causal=True, inputs="positive"),
)
# Over 1,000 tokens, prime lengths (no power of two divides them): several
# default-sized blocks of any tiled kernel, forward and backward, causal or not.
LONG = (
    _c("long", "q1031k1031", q_len=1031, kv_len=1031, q_heads=1, kv_heads=1),
    _c("long", "causal-q1283k1283", q_len=1283, kv_len=1283, causal=True),
    _c("long", "causal-gqa-q1031k1543", q_len=1031, kv_len=1543, q_heads=4, kv_heads=2,
       causal=True, return_lse=True),
)
# Decode steps: a few query rows (1, or 4 for speculative decoding) against a
# longer KV cache with per-sequence lengths, GQA groups, head dim 128 (the size
# decode kernels are built for; the base dim where a manifest rejects 128), in
# every claimed dtype: decode kernels are often bfloat16-only. 600 keys span
# several pages and chunks of a decode kernel (128-token pages, 512-key steps).
DECODE = (
    _c("decode", "q1k300-b3", batch=3, q_len=1, kv_len=300, q_heads=8, kv_heads=2, head_dim=128,
       causal=True, kv_lengths=(300, 129, 1), quick=True),
    _c("decode", "q4k600-spec-b2", batch=2, q_len=4, kv_len=600, q_heads=4, kv_heads=1,
       head_dim=128, causal=True, kv_lengths=(600, 130)),
    _c("decode", "q1k600-softcap-b2", batch=2, q_len=1, kv_len=600, q_heads=4, kv_heads=2,
       head_dim=128, kv_lengths=(7, 600), softcap=5.0),
)
RAGGED = (
    _c("ragged", "lengths-b3", batch=3, q_len=13, kv_len=21, q_lengths=(13, 7, 2),
       kv_lengths=(21, 12, 5)),
    _c("ragged", "segments-b3", batch=3, q_len=13, kv_len=13, segments="packed"),
)

# Attention dropout (a family of its own, suite/test_dropout.py: the oracle
# needs the backend's keep-mask): several tiles of any small-tile options both
# ways, causal or not, Tq != Tk, GQA, lse (of the undropped logits), and a few
# query rows (a decode path must not serve dropout wrongly).
DROPOUT = (
    _c("dropout", "q77k77-gqa-lse", batch=2, q_len=77, kv_len=77, q_heads=4, kv_heads=2,
       return_lse=True, dropout_rate=0.2),
    _c("dropout", "causal-q45k77", q_len=45, kv_len=77, causal=True, dropout_rate=0.5),
    _c("dropout", "q4k37-b2", batch=2, q_len=4, kv_len=37, dropout_rate=0.1),
)

# Quantized K and V (the ``quantized`` family, beside its paged cases;
# forward only): the oracle reads value * scale exactly, so each case is judged
# at its q dtype's tolerance. Several blocks of any small-tile options, GQA,
# causal with Tq != Tk and lse; garbage past kv_lengths (quantized with the
# rest: large, finite); a window with softcap; a decode step over 300 keys;
# MQA with a bias and query lengths.
# All run for the first claimed kv dtype, the quick one for each other, and
# in bfloat16 too where claimed.
QUANTIZED = (
    _c("quantized", "dense-causal-gqa", batch=2, q_len=45, kv_len=77, q_heads=4, kv_heads=2,
       causal=True, lse=True, quick=True),
    _c("quantized", "dense-garbage-lengths", batch=2, q_len=23, kv_len=41, kv_lengths=(41, 19),
       inputs="garbage"),
    _c("quantized", "dense-window-softcap", q_len=37, kv_len=37, window=(9, 0), softcap=5.0),
    _c("quantized", "dense-decode-q1k300", batch=2, q_len=1, kv_len=300, q_heads=8, kv_heads=2,
       kv_lengths=(300, 150)),
    _c("quantized", "dense-mqa-bias-qlengths", batch=2, q_len=19, kv_len=33, q_heads=4,
       kv_heads=1, bias="per_head", q_lengths=(19, 8)),
)

#: Every table by family name, in report order.
TABLES: dict[str, tuple[Case, ...]] = {
    t[0].family: t
    for t in (SHAPES, BLOCKS, GQA, CAUSAL, WINDOW, SEGMENT_IDS, LENGTHS, MASK, BIAS,
              SOFTCAP, RETURN_LSE, COMBINED, MASKED_ROWS, KEY_MASK, MAGNITUDE, SAME_SIGN, RAGGED,
              DECODE, LONG)
}

#: Cases repeated in every claimed dtype besides the primary one ((family, name)).
DTYPE_SWEEP = (
    ("shapes", "q17k17"), ("shapes", "q13k29"), ("gqa", "h4kv2"), ("causal", "q7k19"),
    ("masked_rows", "causal-q23k5"), ("magnitude", "large"), ("bias", "full"),
    ("bias", "per-batch-f32"), ("lengths", "kv-b3"), ("combined", "all"),
    ("key_mask", "segments-empty-b3"), ("key_mask", "decode-q1k300-b2"),
)
#: The float64 row (x64; a manifest claims float64 explicitly): a handful of
#: cases, not :data:`DTYPE_SWEEP` nor :data:`EVERY_DTYPE`, each also as a
#: ``tiles`` twin, run under ``jax.enable_x64``. ``combined-all`` uses every
#: feature (bias, softcap, lse included); the others reach GQA, causal with
#: Tq != Tk, and rows that see no key. What float64 adds is precision, which
#: these judge at float64's tolerance; the narrow dtypes' sweep stays theirs.
WIDE_SWEEP = (
    ("shapes", "q17k17"), ("gqa", "h4kv2"), ("causal", "q7k19"),
    ("masked_rows", "causal-q23k5"), ("combined", "all"),
)
#: The part of :data:`WIDE_SWEEP` kept by ``quick`` (with its tiles twin).
QUICK_WIDE_SWEEP = (("combined", "all"),)
#: Families that run whole in every claimed dtype but float64, not only the primary one.
EVERY_DTYPE = frozenset({"decode"})
#: The part of the sweep kept by ``quick``.
QUICK_SWEEP = (("shapes", "q17k17"),)
#: Families whose cases get no ``tiles`` twin: ``long`` spans several default
#: blocks already (and small tiles would make it slow), ``head_dims`` varies D.
NO_TILES = frozenset({"long", "head_dims"})
#: The ``tiles`` twins kept by ``quick`` ((family, name)).
QUICK_TILES = (("shapes", "q17k17"), ("causal", "q7k19"), ("gqa", "h4kv2"),
               ("combined", "all"))
#: The :data:`QUANTIZED` cases (names) that get a ``tiles`` twin (one per kv
#: dtype, in the primary dtype; none with ``quick``, which keeps only
#: :data:`QUICK_TILES`): the quick case alone, which crosses the small tiles
#: with GQA, causal and lse (CI time).
QUANTIZED_TILES = frozenset({"dense-causal-gqa"})

#: Candidate head dims for the ``head_dims`` family when the manifest sets no list.
HEAD_DIM_CANDIDATES = (8, 32, 64, 128, 256)


def _head_dim_ok(head_dims: Any, d: int) -> bool:
    return not head_dims.reasons(d, "head_dim")


def base_head_dim(head_dims: Any) -> int:
    """Smallest accepted head dim >= 16 (or the smallest accepted at all)."""
    if head_dims.allowed is not None:
        ordered = sorted(head_dims.allowed)
        pool = [d for d in ordered if d >= 16 and _head_dim_ok(head_dims, d)] or [
            d for d in ordered if _head_dim_ok(head_dims, d)
        ]
        if not pool:
            raise ValueError(f"head_dims {head_dims.describe()} accepts no head dim")
        return pool[0]
    m = head_dims.multiple_of
    d = max(m, -(-16 // m) * m)
    if head_dims.max is not None and d > head_dims.max:
        d = (head_dims.max // m) * m
    if d < 1 or not _head_dim_ok(head_dims, d):
        raise ValueError(f"head_dims {head_dims.describe()} accepts no head dim")
    return d


def head_dim_cases(head_dims: Any, base: int) -> tuple[Case, ...]:
    """The ``head_dims`` family: other accepted dims, and Dv != D when possible."""
    pool = sorted(head_dims.allowed) if head_dims.allowed is not None else HEAD_DIM_CANDIDATES
    dims = [d for d in pool if d != base and _head_dim_ok(head_dims, d)][:4]
    out = [_c("head_dims", f"d{d}", head_dim=d, v_head_dim=d, q_len=11, kv_len=11,
              quick=(i == 0)) for i, d in enumerate(dims)]
    if dims:
        out.append(_c("head_dims", f"d{base}-dv{dims[0]}", head_dim=base, v_head_dim=dims[0],
                      q_len=11, kv_len=11))
    return tuple(out)


def cases_for(capabilities: Any, *, quick: bool = False, tiles: bool = True) -> list[Case]:
    """Cases a manifest can serve, head dims filled in, each claimed dtype covered.

    The primary dtype (float32 if claimed, else the first claimed) runs every
    table; each other claimed dtype runs :data:`DTYPE_SWEEP` and the tables
    of :data:`EVERY_DTYPE`, but float64 runs :data:`WIDE_SWEEP` and its
    tiles twins. A case that names a head dim the manifest rejects
    runs at the base head dim instead. With ``tiles``,
    each primary-dtype case outside :data:`NO_TILES` (with ``quick``: those of
    :data:`QUICK_TILES`; of the quantized family, those of
    :data:`QUANTIZED_TILES`) also gets a ``tiles=True`` twin; the suite drops the
    twins of a backend whose ``tile_small_options`` returns None. Cases whose
    features are not all claimed are dropped; ``lse=True`` cases ask for lse
    only when ``return_lse`` is claimed.
    """
    caps = capabilities
    dtypes = sorted(caps.dtypes)
    primary = "float32" if "float32" in caps.dtypes else dtypes[0]
    base = base_head_dim(caps.head_dims)
    tables = dict(TABLES)
    tables["head_dims"] = head_dim_cases(caps.head_dims, base)
    chosen: list[Case] = []
    for table in tables.values():
        for case in table:
            if quick and not case.quick:
                continue
            chosen.append(replace(case, dtype=primary))
    chosen += quantized_cases(caps, primary, quick)
    sweep = QUICK_SWEEP if quick else DTYPE_SWEEP
    by_key = {(c.family, c.name): c for t in tables.values() for c in t}
    wide = []
    for dtype in dtypes:
        if dtype == primary:
            continue
        if dtype in _WIDE_DTYPES:
            keys = QUICK_WIDE_SWEEP if quick else WIDE_SWEEP
            wide += [replace(by_key[key], dtype=dtype) for key in keys]
            continue
        chosen += [replace(by_key[key], dtype=dtype) for key in sweep if key in by_key]
        chosen += [replace(case, dtype=dtype) for family in sorted(EVERY_DTYPE)
                   for case in tables[family] if case.quick or not quick]
    if tiles:
        twins = [c for c in chosen if c.dtype == primary and c.family not in NO_TILES
                 and (not quick or (c.family, c.name) in QUICK_TILES)
                 and (c.family != "quantized" or c.name in QUANTIZED_TILES)]
        chosen += [replace(c, tiles=True) for c in twins + wide]
    chosen += wide
    out = []
    for case in chosen:
        d = case.head_dim if case.head_dim and _head_dim_ok(caps.head_dims, case.head_dim) else base
        case = replace(case, head_dim=d, v_head_dim=case.v_head_dim or d,
                       return_lse=case.return_lse or (case.lse and caps.return_lse))
        if served_features(case, caps) <= caps.features:
            out.append(case)
    return out


def quantized_cases(capabilities: Any, primary: str, quick: bool) -> list[Case]:
    """:data:`QUANTIZED` for the manifest's ``kv_dtypes``: every case for the first
    (in ``QUANTIZED_KV_DTYPES``' order), the quick ones for the
    others, and the first quick one in bfloat16 when claimed beside ``primary``."""
    kv_dtypes = [d for d in QUANTIZED_KV_DTYPES
                 if d in getattr(capabilities, "kv_dtypes", ())]
    out = [replace(c, dtype=primary, kv_dtype=kv) for i, kv in enumerate(kv_dtypes)
           for c in QUANTIZED if c.quick or (i == 0 and not quick)]
    if kv_dtypes and "bfloat16" in capabilities.dtypes and primary != "bfloat16":
        out.append(replace(QUANTIZED[0], dtype="bfloat16", kv_dtype=kv_dtypes[0]))
    return out


def served_features(case: Case, capabilities: Any) -> frozenset[str]:
    """The features of the call the registry hands the backend for ``case``: a key
    mask reaches a manifest with segment ids but no mask as segment ids
    (``attn_backends.Capabilities.served_call``)."""
    features = case.features
    key_mask = case.mask is not None and case.mask.startswith("key")
    if key_mask and not capabilities.mask and capabilities.segment_ids:
        return (features - {"mask"}) | {"segment_ids"}
    return features


#: Per feature, what a small call adds to use it (unclaimed, masking-effect tests).
FEATURE_CALLS: dict[str, dict[str, Any]] = {
    "gqa": {"q_heads": 4, "kv_heads": 2},
    "causal": {"causal": True},
    "window": {"window": (2, 1)},
    "segment_ids": {"segments": "packed", "batch": 2},
    "lengths": {"kv_lengths": (5, 11), "batch": 2},
    "mask": {"mask": "full"},
    "bias": {"bias": "full"},
    "softcap": {"softcap": 5.0},
    "return_lse": {"return_lse": True},
    "dropout": {"dropout_rate": 0.1},
}


def dropout_cases(capabilities: Any) -> list[Case]:
    """The ``dropout`` family for a manifest claiming dropout (else none), in the
    primary dtype and base head dim; ``return_lse`` only where claimed."""
    caps = capabilities
    if not caps.dropout:
        return []
    primary = "float32" if "float32" in caps.dtypes else sorted(caps.dtypes)[0]
    base = base_head_dim(caps.head_dims)
    out = [replace(c, dtype=primary, head_dim=base, v_head_dim=base,
                   return_lse=c.return_lse and caps.return_lse) for c in DROPOUT]
    return [c for c in out if c.features <= caps.features]


def single_case(capabilities: Any, family: str, name: str, feature: str | None = None,
                **overrides: Any) -> Case:
    """A small ``q11/k11`` case in the primary dtype and base head dim, using ``feature``."""
    caps = capabilities
    primary = "float32" if "float32" in caps.dtypes else sorted(caps.dtypes)[0]
    base = base_head_dim(caps.head_dims)
    fields: dict[str, Any] = {"q_len": 11, "kv_len": 11, "head_dim": base, "dtype": primary}
    fields.update(FEATURE_CALLS.get(feature, {}) if feature else {})
    fields.update(overrides)
    fields.setdefault("v_head_dim", fields["head_dim"])
    return Case(name=name, family=family, **fields)


def transform_case(capabilities: Any) -> Case:
    """The case of the transform tests: batch 2, GQA and causal when claimed."""
    caps = capabilities
    return single_case(caps, "transforms", "base", batch=2, q_len=13, kv_len=13, q_heads=4,
                       kv_heads=2 if caps.gqa else 4, causal=caps.causal)
