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


def test_backend_object_route_writes_a_certificate(tmp_path: Path) -> None:
    path = tmp_path / "cert.json"
    code = pytest.main([
        "--pyargs", "attn_backends_contracts", "-q", "-p", "no:cacheprovider", *_REWRITE_OK,
        "--attn-backend-object=attn_backend_reference._plugin:ReferenceBackend",
        "--attn-quick", "--attn-only=unclaimed,output_dtype", f"--attn-json={path}",
    ])
    cert = json.loads(path.read_text())
    assert code == 0 and cert["passed"]
    assert cert["backend"] == "reference" and cert["source"].startswith("object ")
    assert cert["only_families"] == ["output_dtype", "unclaimed"]
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
