"""One error measure and one tolerance table, shared by the probe and the suite.

An output of a backend is compared with a float64 oracle element by element,
the way ``numpy.isclose`` and ``torch.testing.assert_close`` do::

    error = max_i |actual_i - oracle_i| / (atol + rtol * |oracle_i|)

and it passes when ``error <= 1`` (:func:`normalised_error`). ``atol`` covers
the elements near zero (gradients are sums with cancellation, so many of
their elements are), ``rtol`` the rest. Both are read from
:func:`tolerance` by dtype, output and platform. Non-finite values must sit
exactly where the oracle has them (lse is ``-inf`` on rows with no visible
key; everything else is finite), otherwise the error is ``inf``.

:func:`compare` is the one verdict built on them, shared by the runtime
probe, the conformance suite and the repository's tests: ``None`` when an
output agrees with the oracle, else a :class:`Mismatch` whose message names
the cause (a wrong shape, NaN or Inf where the oracle is finite, a wrong
non-finite value, or the worst element beyond tolerance) and the element.

The inputs the numbers assume: q, k, v, the output cotangent and the bias
drawn from a standard normal (so outputs and gradients are of order 1),
head dims 8 to 256, up to a few thousand keys. ``atol`` is an absolute
number and means little for other magnitudes; callers that scale inputs
(the suite's ``large`` case) rely on ``rtol`` and on
:data:`GRADIENT_FINITE_ONLY_INPUTS`.

**Platforms.** A float32 matmul at JAX's default precision is exact float32
on CPU, TensorFloat-32 (10 significant bits) on recent GPUs and one bfloat16
pass (8 significant bits) on TPU (``jax.lax.Precision.DEFAULT``), so float32
has one row per platform; bfloat16 and float16 round their inputs to fewer
bits than that anyway and share one row, and so does float64 (x64), whose
matmuls are float64 everywhere. A platform without rows of its own (a PJRT
plugin's) gets :data:`DEFAULT_ROWS`: float32 as one bfloat16 pass, the
least precise default the table knows.

**Where the numbers come from.** The narrow dtypes follow the element-wise
tolerances of the suites this field trusts:

- PyTorch ``test/test_transformers.py`` (SDPA): ``default_atol`` =
  {float16: 1e-3, bfloat16: 1e-3, float32: 1e-5}, ``default_rtol`` =
  {float16: 1e-3, bfloat16: 1.6e-2, float32: 1.3e-6}, loosened for
  gradients by per-output "fudge factors" measured against a low-precision
  reference (typically 4x to 8x).
- JAX ``tests/pallas/tpu_splash_attention_kernel_test.py`` (TPU, default
  precision): output ``atol=rtol=3e-3``, logsumexp ``atol=rtol=1e-3`` for
  float32 and bfloat16 alike; backward dq/dk/dv ``atol=2e-2, rtol=3e-2``.
- xFormers ``test_mem_eff_attention.py`` and tokamax's shared attention test
  use the same orders: about 1e-2 relative for bfloat16 outputs, a few times
  that for gradients.

float32 on CPU is set from measurement instead, so that a bug shows: in
every case family of the conformance suite, the tolerance is at most 100x
the worst per-element error any backend of this repository reaches there
(measured: at most 85x; the closest any backend comes is 0.14 of a
tolerance), with a floor of 1e-5 (see the
comment at ``_F32_EXACT``). Large same-sign logits (the suite's
``same_sign`` family) have a float32 CPU row of their own for dk and dv,
:data:`INPUT_ROWS`, also measured (the worst in-repo error is 0.2 of it).
The suites above are far looser for float32
(PyTorch's rtol 1.3e-6 is per element but its atol 1e-5 is absolute; splash
runs at TPU precision), so they are not the source of these numbers.
``docs/FAULTS_COVERAGE.md`` of the repository lists the figures and the
command that reproduces them. Loosening a number needs a written reason
next to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_ROWS",
    "GRADIENT_FINITE_ONLY_INPUTS",
    "INPUT_ROWS",
    "OUTPUTS",
    "PLATFORMS",
    "TOLERANCES",
    "Mismatch",
    "Tolerance",
    "compare",
    "normalised_error",
    "tolerance",
]

#: Outputs a comparison can name: the output, lse, and each gradient.
OUTPUTS = ("out", "lse", "dq", "dk", "dv", "dbias")

#: Platforms with rows of their own (core's :data:`attn_backends.PLATFORMS`);
#: any other platform gets :data:`DEFAULT_ROWS`.
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclass(frozen=True)
class Tolerance:
    """``atol`` and ``rtol`` of :func:`normalised_error`; ``why`` cites the source."""

    atol: float
    rtol: float
    why: str

    def __post_init__(self) -> None:
        if not (self.atol > 0 and self.rtol >= 0):
            raise ValueError(
                f"Tolerance needs atol > 0 and rtol >= 0 (atol keeps the measure finite "
                f"where the oracle is 0); got {self.atol=}, {self.rtol=}"
            )


# float32 where matmuls are exact float32 (CPU), set from measurement: the
# worst error any in-repo backend reaches in each case family of the suite is
# at least 1/85 of these, and the closest (flash_pallas's dk) reaches 0.14
# (benchmarks/tolerance_margins.py; the figures per family are in
# docs/FAULTS_COVERAGE.md). Floor: none is below 1e-5, some 80
# float32 ulps of an order-1 value, because blockwise kernels legitimately
# reorder sums of a thousand terms; cases whose error is exactly 0 (one
# visible key, one-hot rows) have no ratio.
_MEASURED = "float32 CPU: <= 85x the worst in-repo error of every family (measured)"
_F32_EXACT = {
    "out": Tolerance(1e-5, 1e-5, _MEASURED),
    "lse": Tolerance(1e-5, 1e-5, _MEASURED),
    # dq, dk and dbias sum over keys (or queries) with cancellation: their
    # elements near 0 carry the absolute error of the whole sum.
    "dq": Tolerance(2.5e-5, 2.5e-5, _MEASURED),
    "dk": Tolerance(2.5e-5, 2.5e-5, _MEASURED),
    "dv": Tolerance(1e-5, 1e-5, _MEASURED),
    "dbias": Tolerance(2.5e-5, 2.5e-5, _MEASURED),
}

# float32 matmuls in one bfloat16 pass (TPU default precision): splash's own
# float32 tolerances, which are measured there.
_F32_BF16_PASS = {
    "out": Tolerance(3e-3, 3e-3, "splash float32 fwd atol=rtol=3e-3 (TPU default precision)"),
    "lse": Tolerance(1e-3, 1e-3, "splash logsumexp atol=rtol=1e-3"),
    "dq": Tolerance(2e-2, 3e-2, "splash bwd atol 2e-2, rtol 3e-2"),
    "dk": Tolerance(2e-2, 3e-2, "splash bwd atol 2e-2, rtol 3e-2"),
    "dv": Tolerance(2e-2, 3e-2, "splash bwd atol 2e-2, rtol 3e-2"),
    "dbias": Tolerance(2e-2, 3e-2, "same sums as dq/dk"),
}

_BF16 = {
    # 8 significant bits: rounding the output alone is 2**-9 relative, and
    # kernels round P to bfloat16 before P@V. atol loosened from PyTorch's
    # 1e-3: per element, outputs near 0 carry the rounding of every P·V term
    # (xla_native's accelerator branch measured 1.01x of 1e-3 at 37 x 45), and
    # jax.nn.dot_product_attention rounds the logits to bfloat16 too
    # (example_dense measured 1.03x of atol 4e-3 on a 0.27 output).
    "out": Tolerance(1e-2, 1.6e-2, "PyTorch bfloat16 rtol 1.6e-2; atol 1e-3 x10, measured"),
    # Loosened from splash's 1e-3: kernels form bfloat16 q*scale before q@k,
    # a 2**-9 relative error in every logit.
    "lse": Tolerance(1e-3, 1e-2, "splash lse 1e-3, loosened: logits from bf16 q*scale"),
    "dq": Tolerance(2e-2, 5e-2, "splash bwd atol 2e-2; custom bwd bfloat16 dq 5e-2"),
    "dk": Tolerance(2e-2, 5e-2, "splash bwd atol 2e-2; custom bwd bfloat16 dk 5e-2"),
    "dv": Tolerance(2e-2, 3e-2, "splash bwd atol 2e-2, rtol 3e-2"),
    "dbias": Tolerance(2e-2, 5e-2, "same sums as dq/dk"),
}

_F16 = {
    # 11 significant bits: PyTorch float16 defaults 1e-3/1e-3, rtol doubled
    # because kernels round P to float16 before P@V.
    "out": Tolerance(1e-3, 2e-3, "PyTorch float16 default 1e-3, x2: P rounded to f16"),
    "lse": Tolerance(1e-3, 2e-3, "splash lse 1e-3, x2: logits from f16 q*scale"),
    # PyTorch's SDPA gradient fudge factors are 4x-8x its output tolerance.
    "dq": Tolerance(4e-3, 1e-2, "PyTorch float16 1e-3 x fudge factor ~8 (rtol), ~4 (atol)"),
    "dk": Tolerance(4e-3, 1e-2, "PyTorch float16 1e-3 x fudge factor ~8 (rtol), ~4 (atol)"),
    "dv": Tolerance(4e-3, 5e-3, "PyTorch float16 1e-3 x fudge factor ~4"),
    "dbias": Tolerance(4e-3, 1e-2, "same sums as dq/dk"),
}

# float32 matmuls in TensorFloat-32 (GPU default precision): 10 significant
# bits like float16, so float16's row.
_F32_TF32 = {
    name: Tolerance(t.atol, t.rtol, f"TF32 matmuls (GPU default precision): as float16; {t.why}")
    for name, t in _F16.items()
}

# float64 (x64; a backend claims it explicitly and computes in it): 53
# significant bits, ulp 2.2e-16 at 1. 1e-10 is some 450,000 ulps of an order-1
# value, room for any order of summing a few thousand terms, while one float32
# step anywhere in the path (2**-24 = 6e-8 relative) misses it by ~600x: a
# backend that claims float64 but computes in float32 fails (rounding only q to
# float32 fails the suite's float64 row by 89x-532x). Measured on cpu over that
# row (attn-backends check): reference reaches at most 9.5e-6 of it, xla_native
# 1.1e-5 (its tiles twins included).
# Every platform's float64 matmul is float64 (no reduced default precision).
_F64_WHY = "float64: ~450,000 ulps; any float32 step misses it by ~600x"
_F64 = {
    "out": Tolerance(1e-10, 1e-10, _F64_WHY),
    "lse": Tolerance(1e-10, 1e-10, _F64_WHY),
    "dq": Tolerance(2.5e-10, 2.5e-10, _F64_WHY + "; sums with cancellation, as float32"),
    "dk": Tolerance(2.5e-10, 2.5e-10, _F64_WHY + "; sums with cancellation, as float32"),
    "dv": Tolerance(1e-10, 1e-10, _F64_WHY),
    "dbias": Tolerance(2.5e-10, 2.5e-10, _F64_WHY + "; sums with cancellation, as float32"),
}

# float32 on CPU for large same-sign logits (the suite's ``positive`` inputs:
# q, k, v uniform in [1, 2), logits 15 to 20 at head dim 64, a peer's test).
# float32 rounds each logit at its own magnitude, 2**-19 near 16 instead of
# 2**-23 near 1, and every probability inherits that error; dv sums hundreds
# of them with no cancellation (dv_k = sum_q p_qk dO_q), so its error grows
# with the logits while the element it is judged against need not. Measured
# (attn-backends check NAME -- --attn-only=same_sign, every in-repo backend,
# tiles twins included), as a share of the base row's dv: a dense float32
# softmax (example_dense) 0.88, flash_pallas (interpret mode) 1.58,
# xla_native 1.98. A backward pass that recomputes P = exp(s - lse) from
# logits rounded otherwise than the forward's (xla_native forms them
# transposed) cannot cancel the lse's rounding the way softmax's own
# normaliser does; forming them as the forward does costs xla_native 23% of
# its time (docs/DESIGN.md, section 6, has the figures). dk and dv are set so
# the worst in-repo error is a fifth of them (xla_native: dk 0.19, dv 0.20;
# the closest the base row comes elsewhere is 0.14); out, lse, dq and dbias
# keep the base row (worst: xla_native's dq, 0.12 of it).
_LARGE_LOGITS = ("float32 CPU, logits 15-20: the worst in-repo error is 1/5 of it "
                 "(measured); rounding grows with the logits")
_F32_EXACT_LARGE_LOGITS = {
    **_F32_EXACT,
    "dk": Tolerance(5e-5, 5e-5, _LARGE_LOGITS),
    "dv": Tolerance(1e-4, 1e-4, _LARGE_LOGITS),
}

#: ``TOLERANCES[platform][dtype][output]``: the whole table, documented above.
TOLERANCES: dict[str, dict[str, dict[str, Tolerance]]] = {
    "cpu": {"float32": _F32_EXACT, "bfloat16": _BF16, "float16": _F16, "float64": _F64},
    "gpu": {"float32": _F32_TF32, "bfloat16": _BF16, "float16": _F16, "float64": _F64},
    "tpu": {"float32": _F32_BF16_PASS, "bfloat16": _BF16, "float16": _F16, "float64": _F64},
}
#: The rows of a platform the table does not name (a PJRT plugin's): float32
#: as the least precise default matmul the table knows (one bfloat16 pass), so
#: a new accelerator is judged by what any of them may do until its own row is
#: written here; the other dtypes as everywhere.
DEFAULT_ROWS: dict[str, dict[str, Tolerance]] = {**TOLERANCES["tpu"]}

#: Case inputs whose *gradients* are compared for finiteness only.
#:
#: Written reason: with q and k scaled by 1e3 the logits reach ~1e6 and the
#: softmax rows are nearly one-hot, so the true dq/dk are close to zero while
#: any flash-style backward (FlashAttention-2, splash, xla_native) recomputes
#: P = exp(s - lse) from a float32 lse whose absolute error is |lse| * 2**-24
#: ~ 0.06: P is off by ~6%, and dS = P * (dP - D) turns that into noise of the
#: size of |dP|, amplified by |k| ~ 1e3 in dq. The gradient is ill-conditioned
#: in float32 for every such kernel (splash measured 116x its dq tolerance),
#: so the suite requires the gradients of these cases to be finite and the
#: output and lse to match the oracle at the usual tolerances.
GRADIENT_FINITE_ONLY_INPUTS = frozenset({"large"})


#: Case inputs with rows of their own, ``INPUT_ROWS[inputs][platform][dtype]``,
#: in place of :data:`TOLERANCES`'s there (elsewhere the table's rows hold):
#: large same-sign logits (``positive``) on CPU in float32, set from
#: measurement (the reason is at ``_F32_EXACT_LARGE_LOGITS``). The narrower
#: rows (TF32, one bfloat16 pass, bfloat16, float16) are 40x to 400x looser
#: than float32 on CPU and are kept for these inputs, unmeasured on them (the
#: suite runs them in the primary dtype only, float32 where claimed).
INPUT_ROWS: dict[str, dict[str, dict[str, dict[str, Tolerance]]]] = {
    "positive": {"cpu": {"float32": _F32_EXACT_LARGE_LOGITS}},
}


def tolerance(dtype: str, output: str, *, platform: str, inputs: str = "normal") -> Tolerance:
    """The tolerance for ``output`` of a call in ``dtype`` run on ``platform``.

    ``dtype``: "float32", "bfloat16", "float16" or "float64" (the dtype of q,
    k, v); ``output``: one of :data:`OUTPUTS`; ``platform``: a contract
    platform name (the platform the backend ran on: its default matmul
    precision decides float32's row); one of :data:`PLATFORMS` has its own
    rows, any other :data:`DEFAULT_ROWS`. ``inputs``: the kind of inputs
    compared (a suite case's ``inputs``); those of :data:`INPUT_ROWS` have
    rows of their own there. Raises ``ValueError`` naming the argument
    otherwise.
    """
    from ..contract.environment import check_platform

    check_platform(platform, "tolerance(): platform")
    for arg, value, known in (("dtype", dtype, tuple(DEFAULT_ROWS)),
                              ("output", output, OUTPUTS)):
        if value not in known:
            raise ValueError(f"tolerance(): {arg} must be one of {known}, got {value!r}")
    own = INPUT_ROWS.get(inputs, {}).get(platform, {}).get(dtype)
    return (own or TOLERANCES.get(platform, DEFAULT_ROWS)[dtype])[output]


def normalised_error(
    actual: object, oracle: object, tol: Tolerance, magnitude: object = None
) -> float:
    """``max_i |actual_i - oracle_i| / (atol + rtol * m_i)``; pass when ``<= 1``.

    ``actual`` and ``oracle``: arrays of one shape (any float dtype, NumPy or
    JAX; compared in float64). ``m_i`` is ``|oracle_i|``, or ``magnitude_i``
    when given: the runtime probe passes
    :func:`attn_backends.oracle.magnitudes`, the size of the terms summed
    into each element, so a gradient that cancels to ~0 (a row that sees one
    key) is judged at the scale of its terms. Non-finite entries must match
    the oracle's exactly (same positions, same value, e.g. ``-inf`` lse on
    fully masked rows), else the error is ``inf``; a shape mismatch is
    ``inf`` too. Empty or all non-finite (and matching) arrays have error 0.
    :func:`compare` gives the verdict on the same number, and says why.
    """
    a = np.asarray(actual, dtype=np.float64)
    o = np.asarray(oracle, dtype=np.float64)
    if _structure("", a, o) is not None:
        return float("inf")
    if not np.isfinite(o).any():
        return 0.0
    return float(_ratio(a, o, tol, magnitude).max())


@dataclass(frozen=True)
class Mismatch:
    """Why one output disagrees with the oracle: what :func:`compare` returns.

    ``output``: the compared output's name; ``cause``: ``"missing"`` (no
    array), ``"shape"``, ``"non_finite"`` (NaN or Inf where the oracle is
    finite), ``"wrong_non_finite"`` (a value other than the oracle's where
    that is non-finite: lse must be ``-inf`` exactly on rows with no visible
    key) or ``"tolerance"``; ``error``: :func:`normalised_error` (``inf``
    for every cause but ``"tolerance"``); ``index``, ``got`` and ``want``:
    the element the message names (the worst one for ``"tolerance"``, the
    first wrong one for the non-finite causes, None for a missing or
    misshapen array); ``message``: all of it in words, starting with
    ``output`` (``str(mismatch)`` is the message).
    """

    output: str
    cause: str
    error: float
    index: tuple[int, ...] | None
    got: float | None
    want: float | None
    message: str

    def __str__(self) -> str:
        return self.message


def compare(
    output: str,
    got: Any,
    want: Any,
    tol: Tolerance,
    scale: Any = None,
    *,
    within: float = 1.0,
    finite_only: bool = False,
) -> Mismatch | None:
    """None when ``got`` agrees with the oracle's ``want``, else why not.

    The one verdict of "agrees with the oracle" for the probe, the suite and
    the repository's tests. ``output`` names the output in the message (one
    of :data:`OUTPUTS`); ``got`` and ``want``: arrays of one shape (any float
    dtype, NumPy or JAX; compared in float64; ``got`` None is a missing
    output); ``tol``: its row of the table, ``tolerance(dtype, output,
    platform=...)``. ``scale``: the per-element ``m_i`` of
    :func:`normalised_error`; by default ``|want_i|``, the strictest (the
    suite's); the probe and the random-call tests pass
    :func:`attn_backends.oracle.magnitudes`, the size of the terms summed into
    each element (>= ``|want_i|``).

    Agreement is: the same shape; non-finite values exactly where the oracle
    has them and equal to its (``-inf`` lse on rows with no visible key;
    everything else finite); and, unless ``finite_only`` (outputs that are
    ill-conditioned in the compared dtype, see
    :data:`GRADIENT_FINITE_ONLY_INPUTS`), a normalised error of at most
    ``within``: 1 is the table; a caller that holds a backend to a share of
    it (the reference backend's own test) passes less. The message names the
    cause and an element: the first wrong one for a non-finite cause, else
    the worst one with its got, want and allowance.
    """
    if not within > 0:
        raise ValueError(f"compare(): within must be > 0, got {within!r}")
    if got is None:
        return Mismatch(output, "missing", float("inf"), None, None, None,
                        f"{output} is missing: no {output} to compare with the float64 oracle")
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    found = _structure(output, g, w)
    if found is not None or finite_only or not np.isfinite(w).any():
        return found
    ratio = _ratio(g, w, tol, scale)
    error = float(ratio.max())
    if error <= within:
        return None
    at = _index(np.argmax(ratio), ratio.shape)
    m = np.abs(w) if scale is None else np.broadcast_to(np.asarray(scale, np.float64), w.shape)
    held = "" if within == 1.0 else f" (held to {within:g}x of it)"
    of = "|want|" if scale is None else "the magnitude of the terms summed into it"
    finite = np.isfinite(w)
    diff = float(np.max(np.abs(g[finite] - w[finite])))
    return Mismatch(
        output, "tolerance", error, at, float(g[at]), float(w[at]),
        f"{output} differs from the float64 oracle by {error:.3g}x its tolerance{held} at "
        f"{at}: got {g[at]:.6g}, want {w[at]:.6g}, allowed {tol.atol:g} + {tol.rtol:g} x "
        f"{float(m[at]):.3g} ({of}); max |got - want| = {diff:.3g}",
    )


def _structure(output: str, g: np.ndarray, w: np.ndarray) -> Mismatch | None:
    """The shape and non-finite part of :func:`compare` (float64 arrays)."""
    if g.shape != w.shape:
        return Mismatch(output, "shape", float("inf"), None, None, None,
                        f"{output} has shape {list(g.shape)}, expected {list(w.shape)} "
                        "(the float64 oracle's)")
    finite = np.isfinite(w)
    bad = finite & ~np.isfinite(g)
    if bad.any():
        at = _index(np.argmax(bad), bad.shape)
        nan, inf = int(np.sum(np.isnan(g) & finite)), int(np.sum(np.isinf(g) & finite))
        return Mismatch(output, "non_finite", float("inf"), at, float(g[at]), float(w[at]),
                        f"{output} has {nan} NaN and {inf} Inf values where the oracle is "
                        f"finite (of {g.size}), the first at {at}: got {g[at]:.6g}, "
                        f"want {w[at]:.6g}")
    wrong = ~finite & (g != w)  # NaN never equals the oracle: it has none to match
    if wrong.any():
        at = _index(np.argmax(wrong), wrong.shape)
        return Mismatch(output, "wrong_non_finite", float("inf"), at, float(g[at]), float(w[at]),
                        f"{output} has {int(wrong.sum())} values that differ from the "
                        "oracle's non-finite ones (lse must be -inf exactly on rows with no "
                        f"visible key), the first at {at}: got {g[at]:.6g}, want {w[at]:.6g}")
    return None


def _ratio(g: np.ndarray, w: np.ndarray, tol: Tolerance, scale: Any) -> np.ndarray:
    """``|g_i - w_i| / (atol + rtol * m_i)`` where ``w`` is finite, 0 elsewhere."""
    m = np.abs(w) if scale is None else np.broadcast_to(np.asarray(scale, np.float64), w.shape)
    finite = np.isfinite(w)
    ratio = np.zeros(w.shape)
    ratio[finite] = np.abs(g[finite] - w[finite]) / (tol.atol + tol.rtol * m[finite])
    return ratio


def _index(flat: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(flat), shape))
