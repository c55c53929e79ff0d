"""A numeric failure says what happened: a finite error, NaN/Inf, or a wrong shape.

Each broken backend below runs the suite's forward cases of one family; the
certificate's failure messages must name the cause, since each needs a
different fix (a wrong formula, an overflow, a layout mistake).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends import Backend, Capabilities, UnsupportedError
from attn_backends_contracts import run_check
from attn_backends_contracts._runner import Outcome
from attn_backends_contracts.tolerances import Tolerance, compare, normalised_error


def _dense(call: Any, q: Any, k: Any, v: Any) -> Any:
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * call.scale
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


class _Broken(Backend):
    """Plain softmax attention (no features, float32, no gradients), then ``break_``."""

    version = "0"
    capabilities = Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                                differentiable=False)

    def __init__(self, name: str, break_: Any):
        self.name = name  # type: ignore[misc]
        self.break_ = break_

    def attend(self, call: Any, q: Any, k: Any, v: Any, operands: Any, options: Any = None) -> Any:
        if call.features:
            raise UnsupportedError(f"{self.name}: no features, got {sorted(call.features)}")
        return self.break_(_dense(call, q, k, v))


def test_suite_failure_says_nan_not_shape_mismatch(tmp_path: Any) -> None:
    """Through the whole suite: the forward failures of a NaN-writing backend say NaN."""
    cert = tmp_path / "cert.json"
    broken = _Broken("broken", lambda out: out.at[:, 0].set(jnp.nan))
    code = run_check(broken, str(cert), ["--attn-quick", "--attn-only=shapes", "-q",
                                         "-p", "no:cacheprovider", "-k", "test_forward"])
    failures = json.loads(cert.read_text())["failures"]
    assert code == 1 and failures, failures
    for failure in failures:
        assert "out has " in failure["message"], failure
        assert "NaN and 0 Inf values where the oracle is finite" in failure["message"], failure
        assert "shape mismatch" not in failure["message"], failure


_TOL = Tolerance(1e-5, 3e-3, "test")


def _outcome(name: str, actual: np.ndarray, expected: np.ndarray) -> Outcome:
    """An Outcome as the runner builds it: errors and mismatches from core's comparison."""
    wrong = compare(name, actual, expected, _TOL)
    return Outcome(case=None,  # type: ignore[arg-type]
                   actual={name: actual}, expected={name: expected},
                   errors={name: normalised_error(actual, expected, _TOL)},
                   mismatches={} if wrong is None else {name: wrong})


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda x: x + 0.5, "out differs from the float64 oracle by 5e+04x its tolerance at "
                            "(0, 0): got 0.5, want 0, allowed 1e-05 + 0.003 x 0 (|want|); "
                            "max |got - want| = 0.5"),
        (lambda x: np.where(x > 0.5, np.nan, x), "out has 2 NaN and 0 Inf values where the "
                                                 "oracle is finite (of 4), the first at (0, 1): "
                                                 "got nan, want 1"),
        (lambda x: np.where(x > 0.5, -np.inf, x), "out has 0 NaN and 2 Inf values"),
        (lambda x: x[:, :1], "out has shape [2, 1], expected [2, 2]"),
    ],
    ids=["finite", "nan", "inf", "shape"],
)
def test_outcome_describes_each_cause(change: Any, says: str) -> None:
    expected = np.array([[0.0, 1.0], [1.0, 0.0]])
    outcome = _outcome("out", change(expected), expected)
    assert outcome.failed(("out", "lse")) == ("out",)
    text = outcome.describe(("out",))
    assert text.startswith("out ") and says in text, text


def test_outcome_describes_a_missing_minus_inf_lse() -> None:
    outcome = _outcome("lse", np.array([0.0, 1.0]), np.array([-np.inf, 1.0]))
    assert outcome.errors["lse"] == float("inf")
    text = outcome.describe(("lse",))
    assert "differ from the oracle's non-finite ones" in text and "got 0, want -inf" in text


def test_outcome_of_an_agreeing_output_has_no_mismatch() -> None:
    expected = np.array([[0.0, 1.0], [1.0, 0.0]])
    outcome = _outcome("out", expected + 1e-6, expected)
    assert outcome.failed(("out",)) == () and outcome.describe(("out",)) == ""
    assert 0 < outcome.errors["out"] <= 1
