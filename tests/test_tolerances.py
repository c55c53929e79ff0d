"""attn_backends.tolerances: the one error measure and table of the probe and the suite."""

from __future__ import annotations

import numpy as np
import pytest
from attn_backends import tolerances as tol_mod
from attn_backends.tolerances import (
    OUTPUTS,
    PLATFORMS,
    TOLERANCES,
    Tolerance,
    normalised_error,
    tolerance,
)

T = Tolerance(1e-3, 1e-2, "test")


def test_error_is_per_element() -> None:
    oracle = np.array([100.0, 0.001, -2.0])
    # 0.5 off at 100 is 0.5 / (1e-3 + 1) of tolerance: within.
    assert normalised_error(oracle + [0.5, 0, 0], oracle, T) == pytest.approx(0.5 / 1.001)
    # 0.009 off at 0.001 is nothing next to max|oracle| = 100 (the old measure
    # passed it) but 0.009 / (1e-3 + 1e-5) of this element's tolerance.
    assert normalised_error(oracle + [0, 0.009, 0], oracle, T) == pytest.approx(0.009 / 1.01e-3)
    assert normalised_error(oracle, oracle, T) == 0.0


def test_non_finite_must_sit_where_the_oracle_has_it() -> None:
    oracle = np.array([-np.inf, 1.0])
    assert normalised_error(np.array([-np.inf, 1.0]), oracle, T) == 0.0
    assert normalised_error(np.array([0.0, 1.0]), oracle, T) == np.inf
    assert normalised_error(np.array([np.inf, 1.0]), oracle, T) == np.inf
    assert normalised_error(np.array([-np.inf, np.nan]), oracle, T) == np.inf
    assert normalised_error(np.zeros(3), np.zeros(2), T) == np.inf
    assert normalised_error(np.full(2, -np.inf), np.full(2, -np.inf), T) == 0.0


def test_table_is_complete_and_checks_itself() -> None:
    for platform in PLATFORMS:
        for dtype in ("float32", "bfloat16", "float16"):
            for output in OUTPUTS:
                t = tolerance(dtype, output, platform=platform)
                assert t is TOLERANCES[platform][dtype][output] and t.why
    with pytest.raises(ValueError, match="atol > 0"):
        Tolerance(0.0, 1e-3, "x")
    with pytest.raises(ValueError, match="platform must be one of .* got 'cuda'"):
        tolerance("float32", "out", platform="cuda")
    with pytest.raises(ValueError, match="output must be one of .* got 'dx'"):
        tolerance("float32", "dx", platform="cpu")


def test_float32_row_follows_the_platforms_matmul_precision() -> None:
    """Exact float32 on CPU is held far tighter than TF32 (GPU) or one bf16 pass (TPU)."""
    for output in OUTPUTS:
        cpu, gpu, tpu = (tolerance("float32", output, platform=p) for p in ("cpu", "gpu", "tpu"))
        for other in (gpu, tpu):
            assert cpu.atol * 10 <= other.atol and cpu.rtol * 10 <= other.rtol, output
    for dtype in ("bfloat16", "float16"):
        rows = {p: TOLERANCES[p][dtype] for p in PLATFORMS}
        assert rows["cpu"] == rows["gpu"] == rows["tpu"]


def test_contracts_reexports_the_same_objects() -> None:
    from attn_backends_contracts import tolerances as suite_tol

    for name in tol_mod.__all__:
        assert getattr(suite_tol, name) is getattr(tol_mod, name)
