"""Running one case: the backend (jitted, through the registry) and the oracle."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._oracle import attention as oracle_attention
from ._oracle import attention_vjp as oracle_vjp
from .cases import Case, make_inputs
from .tolerances import normalised_error, tolerance

#: Keyword arguments of ``attention(...)`` that are static (part of the program).
STATIC = ("scale", "causal", "window", "softcap")
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
    kw = {k: v for k, v in data["kwargs"].items() if v is not None}
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
    """Backend and oracle results of one case, and the normalised errors.

    ``actual`` / ``expected`` map output names (out, lse, dq, dk, dv, dbias)
    to float64 arrays; ``errors`` maps the same names to
    :func:`~attn_backends_contracts.tolerances.normalised_error`;
    ``empty_rows`` is ``[B, Hq, Tq]``, True where no key is visible.
    """

    case: Case
    actual: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    errors: dict[str, float] = field(default_factory=dict)
    empty_rows: np.ndarray | None = None

    def describe(self, names: tuple[str, ...]) -> str:
        """What went wrong with each output in ``names``, in words, joined by "; "."""
        return "; ".join(self._what_happened(n) for n in names if n in self.errors)

    def _what_happened(self, name: str) -> str:
        # An error of inf has three causes that need different fixes: say which.
        got, want = self.actual[name], self.expected[name]
        if got.shape != want.shape:
            return f"{name} has shape {list(got.shape)}, expected {list(want.shape)}"
        finite = np.isfinite(want)
        nan = int(np.sum(np.isnan(got) & finite))
        inf = int(np.sum(np.isinf(got) & finite))
        if nan or inf:
            return (f"{name} has {nan} NaN and {inf} Inf values where the oracle is finite "
                    f"(of {got.size})")
        wrong = int(np.sum(~finite & (got != want)))
        if wrong:
            return (f"{name} has {wrong} values that differ from the oracle's non-finite "
                    "ones (lse must be -inf exactly on rows with no visible key)")
        diff = float(np.max(np.abs(got - want))) if got.size else 0.0
        return (f"{name} error {self.errors[name]:.3g} x tolerance "
                f"(finite: max |actual - oracle| = {diff:.3g})")


def _program(attention: Any, capabilities: Any, case: Case, data: dict[str, Any]) -> Callable[..., Any]:
    """``program(*args)`` -> (primal, grads): the case's plain forward (the
    backend's primal path) and, when claimed, its VJP (the differentiated path)."""
    f = bound(attention, case, data)
    differentiable = capabilities.differentiable
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


def run_cases(runs: Sequence[tuple[Any, Case]], capabilities: Any, *, platform: str) -> list[Outcome]:
    """Forward and (when claimed) VJP of each ``(attention, case)``, vs the oracle.

    ``platform`` is where ``attention`` runs; it picks the tolerance row.

    The cases are compiled as one jitted program: each case is its own
    independent subcomputation with its own inputs and static flags, so its
    numbers are those of the case alone, and a batch of 16 compiles with about
    30% less CPU time than its cases one by one (compilation dominates the
    suite). A
    batch that raises is run again case by case by the caller, so an error is
    reported against the case that caused it.
    """
    datas = [make_inputs(case) for _, case in runs]
    programs = [_program(att, capabilities, case, data) for (att, case), data in zip(runs, datas)]
    args = []
    for data in datas:
        _, arrays, bias = split_kwargs(data["kwargs"])
        args.append((data["q"], data["k"], data["v"], bias, arrays, data["d_out"], data["d_lse"]))

    def batch(args: Any) -> Any:
        return [program(*a) for program, a in zip(programs, args)]

    results = compiled(batch, args)(args)
    return [_outcome(case, data, primal, grads, capabilities.differentiable, platform)
            for (_, case), data, (primal, grads) in zip(runs, datas, results)]


def run_case(attention: Any, capabilities: Any, case: Case, *, platform: str) -> Outcome:
    """:func:`run_cases` for one case: its own program."""
    return run_cases([(attention, case)], capabilities, platform=platform)[0]


def _outcome(case: Case, data: dict[str, Any], primal: Any, grads: Any, differentiable: bool,
             platform: str) -> Outcome:
    actual: dict[str, np.ndarray] = {}
    out = primal[0] if case.return_lse else primal
    actual["out"] = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    if case.return_lse:
        actual["lse"] = np.asarray(primal[1], np.float64)
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads, strict=False):
        actual[name] = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
    expected = oracle(case, data, differentiable)
    errors = {
        name: normalised_error(value, expected[name],
                               tolerance(case.dtype, name, platform=platform))
        for name, value in actual.items()
    }
    return Outcome(case, actual, expected, errors, np.isneginf(expected["lse"]))
