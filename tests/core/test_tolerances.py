"""attn_backends.tolerances: the one error measure, table and comparison (probe and suite)."""

from __future__ import annotations

import numpy as np
import pytest
from attn_backends.tolerances import (
    DEFAULT_ROWS,
    INPUT_ROWS,
    OUTPUTS,
    PLATFORMS,
    TOLERANCES,
    Tolerance,
    compare,
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
        for dtype in ("float32", "bfloat16", "float16", "float64"):
            for output in OUTPUTS:
                t = tolerance(dtype, output, platform=platform)
                assert t is TOLERANCES[platform][dtype][output] and t.why
    with pytest.raises(ValueError, match="atol > 0"):
        Tolerance(0.0, 1e-3, "x")
    with pytest.raises(ValueError, match="platform: 'cuda' is JAX's name for the contract's 'gpu'"):
        tolerance("float32", "out", platform="cuda")
    with pytest.raises(ValueError, match="platform: 'gpuu' is not a platform name; did you mean"):
        tolerance("float32", "out", platform="gpuu")
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


def test_large_logit_inputs_loosen_only_cpu_float32_dk_and_dv() -> None:
    """The ``positive`` inputs' own row replaces float32 on cpu, dk and dv looser
    (measured), and nothing else: other platforms, dtypes and inputs keep the table."""
    for output in OUTPUTS:
        base = tolerance("float32", output, platform="cpu")
        own = tolerance("float32", output, platform="cpu", inputs="positive")
        assert own is INPUT_ROWS["positive"]["cpu"]["float32"][output]
        if output in ("dk", "dv"):
            assert own.atol > base.atol and own.rtol > base.rtol and "measured" in own.why
        else:
            assert own is base
        for platform, dtype in (("gpu", "float32"), ("tpu", "float32"), ("cpu", "bfloat16")):
            assert tolerance(dtype, output, platform=platform, inputs="positive") is (
                TOLERANCES[platform][dtype][output])
        assert tolerance("float32", output, platform="cpu", inputs="large") is base


def test_compare_passes_what_the_measure_passes_and_names_the_worst_element() -> None:
    oracle = np.array([[100.0, 0.001], [-2.0, 0.0]])
    assert compare("out", oracle + 0.5, oracle, T) is not None  # 0.5 at 0.001: far out
    assert compare("out", oracle, oracle, T) is None
    near = oracle.copy()
    near[0, 0] += 0.5  # 0.5 / 1.001 of its tolerance: within
    assert compare("out", near, oracle, T) is None
    far = oracle.copy()
    far[0, 1] += 0.009  # 8.9x at the element near 0, the worst one
    wrong = compare("dq", far, oracle, T)
    assert wrong is not None and wrong.cause == "tolerance" and wrong.output == "dq"
    assert wrong.error == pytest.approx(normalised_error(far, oracle, T))
    assert wrong.index == (0, 1) and wrong.got == pytest.approx(0.01) and wrong.want == 0.001
    assert str(wrong) == wrong.message
    assert wrong.message.startswith("dq differs from the float64 oracle by 8.91x its tolerance "
                                    "at (0, 1): got 0.01, want 0.001, allowed 0.001 + 0.01 x 0.001 "
                                    "(|want|)")


def test_compare_reads_the_scale_it_is_given() -> None:
    oracle = np.array([0.0, 1.0])
    got = oracle + [0.005, 0.0]
    assert compare("dq", got, oracle, T) is not None  # 0.005 / 1e-3 at |want| = 0
    # At the magnitude of the summed terms (here 1), 0.005 / (1e-3 + 1e-2): within.
    assert compare("dq", got, oracle, T, scale=np.array([1.0, 1.0])) is None
    wrong = compare("dq", got * 10, oracle, T, scale=np.array([1.0, 1.0]))
    assert wrong is not None and "the magnitude of the terms summed into it" in wrong.message


def test_compare_within_holds_to_a_share_of_the_tolerance() -> None:
    oracle = np.array([1.0])
    got = oracle + 0.005  # 0.005 / 0.011 = 0.45 of the tolerance
    assert compare("out", got, oracle, T) is None
    wrong = compare("out", got, oracle, T, within=0.25)
    assert wrong is not None and "(held to 0.25x of it)" in wrong.message
    assert wrong.error == pytest.approx(0.005 / 0.011)
    with pytest.raises(ValueError, match="within must be > 0"):
        compare("out", got, oracle, T, within=0.0)


@pytest.mark.parametrize(
    ("got", "cause", "says"),
    [
        (np.array([-np.inf, 1.0, np.nan]), "non_finite",
         "out has 1 NaN and 0 Inf values where the oracle is finite (of 3), the first at (2,)"),
        (np.array([-np.inf, np.inf, np.inf]), "non_finite", "out has 0 NaN and 2 Inf values"),
        (np.array([0.0, 1.0, 2.0]), "wrong_non_finite",
         "out has 1 values that differ from the oracle's non-finite ones (lse must be -inf "
         "exactly on rows with no visible key), the first at (0,): got 0, want -inf"),
        (np.array([np.inf, 1.0, 2.0]), "wrong_non_finite", "got inf, want -inf"),
        (np.array([np.nan, 1.0, 2.0]), "wrong_non_finite", "got nan, want -inf"),
        (np.zeros(2), "shape", "out has shape [2], expected [3]"),
        (None, "missing", "out is missing"),
    ],
    ids=["nan", "inf", "finite-for-minus-inf", "plus-inf", "nan-for-minus-inf", "shape", "none"],
)
def test_compare_names_each_non_finite_cause(got, cause, says) -> None:
    oracle = np.array([-np.inf, 1.0, 2.0])
    wrong = compare("out", got, oracle, T)
    assert wrong is not None and wrong.cause == cause and wrong.error == np.inf, wrong
    assert says in wrong.message, wrong.message
    if got is not None:
        assert normalised_error(got, oracle, T) == np.inf
    # finite_only skips the tolerance, never the shape or the non-finite checks.
    assert compare("out", got, oracle, T, finite_only=True) is not None


def test_compare_finite_only_ignores_the_size_of_the_error() -> None:
    oracle = np.array([-np.inf, 1.0])
    assert compare("dq", np.array([-np.inf, 1e6]), oracle, T, finite_only=True) is None
    assert compare("dq", np.array([-np.inf, 1e6]), oracle, T) is not None
    assert compare("lse", np.full(2, -np.inf), np.full(2, -np.inf), T) is None
    assert compare("out", np.zeros((0, 3)), np.zeros((0, 3)), T) is None


def test_compare_warns_about_nothing() -> None:
    """Callers run under warnings-as-errors: -inf - -inf must not reach NumPy."""
    import warnings

    oracle = np.array([-np.inf, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compare("lse", np.array([-np.inf, 3.0]), oracle, T) is not None
        assert compare("lse", np.array([-np.inf, 1.0]), oracle, T) is None


def test_a_platform_without_rows_gets_the_default_rows() -> None:
    """A PJRT plugin's platform is judged by the default rows: float32 as the least
    precise default matmul the table knows (one bfloat16 pass, TPU's)."""
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        for output in OUTPUTS:
            t = tolerance(dtype, output, platform="neuron")
            assert t is DEFAULT_ROWS[dtype][output]
            assert t.atol >= max(TOLERANCES[p][dtype][output].atol for p in PLATFORMS)


def test_float64_row_fails_a_float32_step_and_passes_float64_rounding() -> None:
    """float64 is held to float64: one float32 rounding of an order-1 output fails,
    while the rounding of a thousand-term float64 sum passes by far."""
    rng = np.random.default_rng(0)
    want = rng.standard_normal(4096)
    for platform in PLATFORMS:
        for output in OUTPUTS:
            tol = tolerance("float64", output, platform=platform)
            assert compare(output, want.astype(np.float32), want, tol) is not None, output
            summed = want + want * 1000 * np.finfo(np.float64).eps
            assert normalised_error(summed, want, tol) < 0.01
            assert tol.atol * 1e4 <= tolerance("float32", output, platform="cpu").atol
