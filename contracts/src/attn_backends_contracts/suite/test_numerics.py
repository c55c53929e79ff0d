"""Every case of the table: forward (out, lse) and gradients against the float64 oracle.

Parametrized by ``attn_case`` from the backend's manifest
(:func:`attn_backends_contracts.cases.cases_for`); the case's family is what
the summary and the certificate report.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from attn_backends_contracts import tolerances
from attn_backends_contracts._inputs import make_inputs
from attn_backends_contracts._runner import bound, split_kwargs


def _skip_declined(suite: Any, case: Any) -> None:
    reasons = suite.declined(case)
    if reasons:
        pytest.skip(f"declined by the backend's check(): {'; '.join(reasons)}")


def test_forward(attn_suite: Any, attn_case: Any) -> None:
    """out (and lse when asked) equal the oracle; rows with no visible key are exactly 0."""
    _skip_declined(attn_suite, attn_case)
    outcome = attn_suite.outcome(attn_case)
    names = tuple(n for n in ("out", "lse") if n in outcome.errors)
    attn_suite.note_errors(attn_case.dtype, {n: outcome.errors[n] for n in names})
    bad = outcome.failed(names)
    assert not bad, f"{attn_case.id}: {outcome.describe(bad)}"
    out = outcome.actual["out"].transpose(0, 2, 1, 3)  # [B, Hq, Tq, Dv]
    empty = out[outcome.empty_rows]
    assert np.all(empty == 0), (
        f"{attn_case.id}: rows with no visible key must output exactly 0, got max "
        f"|out| {np.max(np.abs(empty)):.3g}"
    )


def test_gradients(attn_suite: Any, attn_case: Any) -> None:
    """dq, dk, dv (and dbias when bias_grad is claimed) equal the oracle's VJP; a
    quantized K and V's gradient raises UnsupportedError (forward only)."""
    if attn_case.kv_dtype is not None:
        return _gradient_refused(attn_suite, attn_case)
    if not attn_suite.caps.differentiable:
        pytest.skip("differentiable=False: test_unclaimed checks that gradients raise")
    _skip_declined(attn_suite, attn_case)
    outcome = attn_suite.outcome(attn_case)
    names = tuple(n for n in ("dq", "dk", "dv", "dbias") if n in outcome.errors)
    # Cases of tolerances.GRADIENT_FINITE_ONLY_INPUTS (ill-conditioned in
    # float32 for flash-style backward passes; the written reason is there)
    # have their gradients compared for shape and finiteness only, and their
    # errors left out of the worst-error summary.
    if attn_case.inputs not in tolerances.GRADIENT_FINITE_ONLY_INPUTS:
        attn_suite.note_errors(attn_case.dtype, {n: outcome.errors[n] for n in names})
    bad = outcome.failed(names)
    assert not bad, f"{attn_case.id}: {outcome.describe(bad)}"


def _gradient_refused(suite: Any, case: Any) -> None:
    """Attention over a quantized K and V is forward only (docs/DESIGN.md,
    "Quantized caches"): its gradient raises, never returns a number."""
    import attn_backends
    import jax
    import jax.numpy as jnp

    _skip_declined(suite, case)
    data = make_inputs(case)
    _, arrays, bias = split_kwargs(data["kwargs"])
    f = bound(suite.attention_for(case), case, data)

    def loss(q: Any) -> Any:
        out = f(q, data["k"], data["v"], bias, arrays)
        return jnp.sum((out[0] if case.return_lse else out).astype(jnp.float32))

    with pytest.raises(attn_backends.UnsupportedError, match="forward only"):
        jax.eval_shape(jax.grad(loss), data["q"])
