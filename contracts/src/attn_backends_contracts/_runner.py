"""Running one case: the backend (jitted, through the registry) and the oracle."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ._case import Case
from ._inputs import make_inputs, wide, x64_for
from ._oracle import attention as oracle_attention
from ._oracle import attention_vjp as oracle_vjp
from .tolerances import GRADIENT_FINITE_ONLY_INPUTS, Mismatch, compare, normalised_error, tolerance

#: Keyword arguments of ``attention(...)`` that are static (part of the program).
STATIC = ("scale", "causal", "window", "softcap", "dropout_rate")
#: Executables by lowered program text: identical programs (the same backend
#: code reached by several suite runs in one process, e.g. the repo's tests of
#: broken variants) compile once. Debug locations are not part of the key.
_COMPILED: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
_MAX_COMPILED = 512


def compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``jax.jit(fn)`` compiled for ``args``, reusing an identical earlier program."""
    lowered = jax.jit(fn).lower(*args)
    key = (lowered.as_text(), str(lowered.in_tree), str(lowered.out_tree))
    exe = _COMPILED.get(key)
    if exe is None:
        exe = lowered.compile()
        _COMPILED[key] = exe
        if len(_COMPILED) > _MAX_COMPILED:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
    return exe


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(static kwargs, array operands except bias, bias or None)."""
    static = {k: kwargs[k] for k in STATIC if k in kwargs}
    arrays = {k: v for k, v in kwargs.items() if k not in STATIC and k != "bias"}
    return static, arrays, kwargs.get("bias")


def bound(attention: Any, case: Case, data: dict[str, Any]) -> Callable[..., Any]:
    """``f(q, k, v, bias, arrays)`` calling ``attention`` with the case's static flags."""
    static, _, _ = split_kwargs(data["kwargs"])

    def f(q: Any, k: Any, v: Any, bias: Any, arrays: dict[str, Any]) -> Any:
        return attention(q, k, v, bias=bias, return_lse=case.return_lse, **arrays, **static)

    return f


def oracle(case: Case, data: dict[str, Any], differentiable: bool) -> dict[str, np.ndarray]:
    """Float64 oracle outputs: out, lse and (if ``differentiable``) dq, dk, dv, dbias."""
    # A quantized K and V's scales are in k64 and v64 already (dequantized).
    kw = {k: v for k, v in data["kwargs"].items()
          if v is not None and k not in ("k_scales", "v_scales")}
    if "bias" in kw:
        kw["bias"] = np.asarray(kw["bias"], np.float64)
    q, k, v = data["q64"], data["k64"], data["v64"]
    out, lse = oracle_attention(q, k, v, **kw)
    result = {"out": out, "lse": lse}
    if differentiable:
        d_lse = data["d_lse"] if case.return_lse else None
        grads = oracle_vjp(q, k, v, data["d_out64"], d_lse=d_lse, **kw)
        result.update(dq=grads["q"], dk=grads["k"], dv=grads["v"], dbias=grads["bias"])
    return result


@dataclass
class Outcome:
    """Backend and oracle results of one case, and how they compare.

    ``actual`` / ``expected`` map output names (out, lse, dq, dk, dv, dbias)
    to float64 arrays; ``errors`` maps the same names to
    :func:`~attn_backends.tolerances.normalised_error` (the summary's worst
    errors); ``mismatches`` maps each output that disagrees with the oracle
    to its :class:`~attn_backends.tolerances.Mismatch`, as
    :func:`~attn_backends.tolerances.compare` judges it (the gradients of
    :data:`~attn_backends.tolerances.GRADIENT_FINITE_ONLY_INPUTS` cases for
    finiteness only); ``empty_rows`` is ``[B, Hq, Tq]``, True where no key is
    visible.
    """

    case: Case
    actual: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    errors: dict[str, float] = field(default_factory=dict)
    empty_rows: np.ndarray | None = None
    mismatches: dict[str, Mismatch] = field(default_factory=dict)

    def failed(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``names`` that disagree with the oracle."""
        return tuple(n for n in names if n in self.mismatches)

    def describe(self, names: tuple[str, ...]) -> str:
        """What went wrong with each output in ``names``, in words, joined by "; "."""
        return "; ".join(str(self.mismatches[n]) for n in self.failed(names))


def _differentiable(capabilities: Any, case: Case) -> bool:
    """Whether the case's gradients are judged: claimed, and not a quantized K
    and V (forward only by the contract)."""
    return bool(capabilities.differentiable) and case.kv_dtype is None


def _program(
    attention: Any, capabilities: Any, case: Case, data: dict[str, Any]
) -> Callable[..., Any]:
    """``program(*args)`` -> (primal, grads): the case's plain forward (the
    backend's primal path) and, when claimed, its VJP (the differentiated path)."""
    f = bound(attention, case, data)
    differentiable = _differentiable(capabilities, case)
    grad_bias = data["kwargs"].get("bias") is not None and capabilities.bias_grad

    def program(q: Any, k: Any, v: Any, bias: Any, arrays: Any, d_out: Any, d_lse: Any) -> Any:
        primal = f(q, k, v, bias, arrays)
        if not differentiable:
            return primal, ()
        if grad_bias:
            _, vjp = jax.vjp(lambda q, k, v, b: f(q, k, v, b, arrays), q, k, v, bias)
        else:
            _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, bias, arrays), q, k, v)
        return primal, vjp((d_out, d_lse) if case.return_lse else d_out)

    return program


def run_cases(
    runs: Sequence[tuple[Any, Case]], capabilities: Any, *, platform: str
) -> list[Outcome]:
    """Forward and (when claimed) VJP of each ``(attention, case)``, vs the oracle.

    ``platform`` is where ``attention`` runs; it picks the tolerance row.

    The cases are compiled as one jitted program: each case is its own
    independent subcomputation with its own inputs and static flags, so its
    numbers are those of the case alone, and a batch of 16 compiles with about
    30% less CPU time than its cases one by one (compilation dominates the
    suite). A
    batch that raises is run again case by case by the caller, so an error is
    reported against the case that caused it. The cases of one batch share
    their x64 setting (:func:`~._inputs.x64_for`): float64 cases run under
    ``jax.enable_x64``, the others without it.
    """
    if len({wide(case.dtype) for _, case in runs}) > 1:
        raise ValueError("run_cases: a batch mixes float64 cases with others (x64 differs)")
    with x64_for(runs[0][1].dtype):
        return _run_cases(runs, capabilities, platform=platform)


def _run_cases(
    runs: Sequence[tuple[Any, Case]], capabilities: Any, *, platform: str
) -> list[Outcome]:
    datas = [make_inputs(case) for _, case in runs]
    programs = [_program(att, capabilities, case, data)
                for (att, case), data in zip(runs, datas, strict=True)]
    args = []
    for data in datas:
        _, arrays, bias = split_kwargs(data["kwargs"])
        args.append((data["q"], data["k"], data["v"], bias, arrays, data["d_out"], data["d_lse"]))

    def batch(args: Any) -> Any:
        return [program(*a) for program, a in zip(programs, args, strict=True)]

    results = compiled(batch, args)(args)
    return [_outcome(case, data, primal, grads, _differentiable(capabilities, case), platform)
            for (_, case), data, (primal, grads) in zip(runs, datas, results, strict=True)]


def run_case(attention: Any, capabilities: Any, case: Case, *, platform: str) -> Outcome:
    """:func:`run_cases` for one case: its own program."""
    return run_cases([(attention, case)], capabilities, platform=platform)[0]


def _outcome(case: Case, data: dict[str, Any], primal: Any, grads: Any, differentiable: bool,
             platform: str) -> Outcome:
    actual: dict[str, np.ndarray] = {}
    out = primal[0] if case.return_lse else primal
    # Every dtype converts to float64 exactly (a float64 output keeps its bits).
    actual["out"] = np.asarray(out).astype(np.float64)
    if case.return_lse:
        actual["lse"] = np.asarray(primal[1], np.float64)
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads, strict=False):
        actual[name] = np.asarray(g).astype(np.float64)
    expected = oracle(case, data, differentiable)
    errors, mismatches = {}, {}
    for name, value in actual.items():
        tol = tolerance(case.dtype, name, platform=platform, inputs=case.inputs)
        errors[name] = normalised_error(value, expected[name], tol)
        # Ill-conditioned in float32 for flash-style backward passes: see
        # GRADIENT_FINITE_ONLY_INPUTS for the written reason.
        finite_only = name.startswith("d") and case.inputs in GRADIENT_FINITE_ONLY_INPUTS
        wrong = compare(name, value, expected[name], tol, finite_only=finite_only)
        if wrong is not None:
            mismatches[name] = wrong
    return Outcome(case, actual, expected, errors, np.isneginf(expected["lse"]), mismatches)
