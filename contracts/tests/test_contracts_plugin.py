"""The pytest plugin: inert unless asked, and the object route (--attn-backend-object)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from attn_backends_contracts.cases import cases_for

# The caller already imported the package, so pytest cannot rewrite it: expected.
_REWRITE_OK = ["-W", "ignore:Module already imported:pytest.PytestAssertRewriteWarning"]


def test_loading_the_plugin_imports_no_jax() -> None:
    code = (
        "import sys, attn_backends_contracts.plugin, attn_backends_contracts; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'attn_backends')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_suite_without_a_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # A CI job that forgets --attn-backend must fail, not pass with all skipped.
    code = pytest.main(
        ["--pyargs", "attn_backends_contracts", "-q", "-p", "no:cacheprovider", *_REWRITE_OK]
    )
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.strip()]
    assert code == pytest.ExitCode.USAGE_ERROR, captured.out
    assert len(errors) == 1 and "pass --attn-backend=NAME" in errors[0], errors
    assert "passed" not in captured.out and "skipped" not in captured.out


def test_backend_object_route_writes_a_certificate(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cert.json"
    # Read when the certificate is written (this process's XLA started long ago).
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    code = pytest.main([
        "--pyargs", "attn_backends_contracts", "-q", "-p", "no:cacheprovider", *_REWRITE_OK,
        "--attn-backend-object=attn_backend_reference._plugin:ReferenceBackend",
        "--attn-quick", "--attn-only=unclaimed,output_dtype", f"--attn-json={path}",
    ])
    cert = json.loads(path.read_text())
    assert code == 0 and cert["passed"]
    assert cert["backend"] == "reference" and cert["source"].startswith("object ")
    assert cert["only_families"] == ["output_dtype", "unclaimed"]
    assert cert["xla_flags"] == "--xla_backend_optimization_level=0"
    for key in ("jax", "jaxlib", "libtpu", "platform", "device_kind", "api_version", "date"):
        assert key in cert


def test_cases_follow_the_manifest() -> None:
    from attn_backends import Capabilities, HeadDims

    caps = Capabilities(platforms={"tpu"}, dtypes={"bfloat16"}, causal=True,
                        head_dims=HeadDims(multiple_of=64, max=256))
    cases = cases_for(caps)
    assert cases and all(c.dtype == "bfloat16" for c in cases)
    assert all(c.features <= {"causal"} for c in cases)
    assert all(c.head_dim % 64 == 0 and c.head_dim <= 256 for c in cases)
    assert {c.family for c in cases} >= {"shapes", "causal", "masked_rows", "head_dims"}
    assert any(c.q_len != c.kv_len and c.causal for c in cases)


def test_key_mask_cases_reach_a_manifest_with_segment_ids_but_no_mask() -> None:
    from attn_backends import Capabilities

    ids_only = cases_for(Capabilities(platforms={"cpu"}, causal=True, segment_ids=True))
    families = {c.family for c in ids_only}
    assert "key_mask" in families and "mask" not in families
    assert any(c.mask == "key_empty" and c.segments for c in ids_only)
    neither = cases_for(Capabilities(platforms={"cpu"}, causal=True))
    assert not any(c.family == "key_mask" for c in neither)
    masker = cases_for(Capabilities(platforms={"cpu"}, causal=True, mask=True))
    assert {c.name for c in masker if c.family == "key_mask"} == {
        "b2", "empty-example-b3", "shared-causal-q13k29", "q130k300-b2"}


def test_tiles_twins_and_long_cases() -> None:
    from attn_backends import FEATURES, Capabilities
    from attn_backends_contracts.cases import NO_TILES

    caps = Capabilities(platforms={"cpu"}, dtypes={"float32", "bfloat16"},
                        **{f: True for f in FEATURES}, bias_grad=True, differentiable=True)
    cases = cases_for(caps)
    plain = {(c.family, c.name) for c in cases if not c.tiles}
    twins = [c for c in cases if c.tiles]
    assert len(twins) > 40 and all((c.family, c.name) in plain for c in twins)
    assert all(c.dtype == "float32" and c.family not in NO_TILES for c in twins)
    assert all(c.id.endswith("-tiles") for c in twins)
    long = [c for c in cases if c.family == "long"]
    assert {c.causal for c in long} == {True, False}
    for c in long:  # over 1,000 tokens, no power of two divides the lengths
        assert min(c.q_len, c.kv_len) > 1000 and c.q_len % 2 and c.kv_len % 2
    quick = cases_for(caps, quick=True)
    assert not any(c.family == "long" for c in quick)
    # A manifest claiming every feature keeps exactly the listed quick twins.
    assert sorted((c.family, c.name) for c in quick if c.tiles) == [
        ("causal", "q7k19"), ("combined", "all"), ("gqa", "h4kv2"), ("shapes", "q17k17")]
    assert not any(c.tiles for c in cases_for(caps, tiles=False))


def test_quantized_twins_are_those_of_quantized_tiles() -> None:
    from attn_backends.authoring import FEATURES, QUANTIZED_KV_DTYPES, Capabilities
    from attn_backends_contracts.cases import QUANTIZED, QUANTIZED_TILES

    assert QUANTIZED_TILES <= {c.name for c in QUANTIZED}  # a typo would drop twins
    caps = Capabilities(platforms={"cpu"}, dtypes={"float32", "bfloat16"},
                        kv_dtypes=set(QUANTIZED_KV_DTYPES), **{f: True for f in FEATURES},
                        bias_grad=True, differentiable=True)
    twins = [c for c in cases_for(caps) if c.family == "quantized" and c.tiles]
    # Named here, not read from QUANTIZED_TILES: the one case whose twins the
    # family runs (GQA causal, Tq != Tk, across the small tiles), per kv dtype.
    assert sorted((c.name, c.dtype, c.kv_dtype) for c in twins) == sorted(
        ("dense-causal-gqa", "float32", kv) for kv in QUANTIZED_KV_DTYPES)
    assert not any(c.family == "quantized" and c.tiles for c in cases_for(caps, quick=True))


def test_suite_runs_tiles_twins_under_the_backends_small_tile_options() -> None:
    from attn_backend_reference import ReferenceBackend
    from attn_backends_contracts._session import Suite

    class Tiled(ReferenceBackend):
        def tile_small_options(self, call: object) -> object:
            return ("small", 8) if call.kv_len > 16 else None  # type: ignore[attr-defined]

    suite = Suite(Tiled(), source="test", platform="cpu", quick=True)
    twins = [c for c in suite.cases if c.tiles]
    assert twins and all(c.kv_len > 16 for c in twins)
    attention = suite.attention_for(twins[0])
    assert attention is not suite.attention
    assert attention.backend_options == {"reference": ("small", 8)}
    assert suite.attention_for(twins[-1]) is attention  # one Attention per options
    untiled = Suite(ReferenceBackend(), source="test", platform="cpu", quick=True)
    assert not any(c.tiles for c in untiled.cases)


def test_float64_row_is_a_handful_of_cases_and_their_twins() -> None:
    from attn_backends.authoring import CLAIMABLE_DTYPES, FEATURES, Capabilities
    from attn_backends_contracts.cases import QUICK_WIDE_SWEEP, WIDE_SWEEP

    caps = Capabilities(platforms={"cpu"}, dtypes=CLAIMABLE_DTYPES,
                        **{f: True for f in FEATURES}, bias_grad=True, differentiable=True)
    for quick, sweep in ((False, WIDE_SWEEP), (True, QUICK_WIDE_SWEEP)):
        wide = [c for c in cases_for(caps, quick=quick) if c.dtype == "float64"]
        assert sorted((c.family, c.name, c.tiles) for c in wide) == sorted(
            (f, n, t) for f, n in sweep for t in (False, True))
    narrow = Capabilities(platforms={"cpu"}, **{f: True for f in FEATURES})
    assert not any(c.dtype == "float64" for c in cases_for(narrow))


def test_float64_cases_run_under_x64_in_batches_of_their_own() -> None:
    from attn_backend_reference import ReferenceBackend
    from attn_backends_contracts._runner import run_cases
    from attn_backends_contracts._session import Suite

    suite = Suite(ReferenceBackend(), source="test", platform="cpu", quick=False)
    wide = [c for c in suite.cases if c.dtype == "float64"]
    narrow = [c for c in suite.cases if c.dtype == "float32"]
    suite.plan([narrow[0], wide[0], narrow[1], wide[1]])
    assert suite._batch_for(narrow[0]) == [narrow[0], narrow[1]]
    assert suite._batch_for(wide[0]) == [wide[0], wide[1]]
    outcome = suite.outcome(wide[0])
    assert not outcome.mismatches and outcome.errors["out"] < 1e-3  # of 1e-10: float64 kept
    with pytest.raises(ValueError, match="mixes float64 cases with others"):
        run_cases([(suite.attention, narrow[0]), (suite.attention, wide[0])], suite.caps,
                  platform="cpu")
