"""`attn-backends bench --decode`: decode steps timed against the jnp.sum bandwidth."""

from __future__ import annotations

import json

import pytest
from attn_backends_cli.main import main


@pytest.fixture(autouse=True)
def two_backends(monkeypatch):
    import attn_backends

    monkeypatch.setattr(
        attn_backends.choose.registry, "registry",
        attn_backends.Registry(only=["reference", "xla_native"])
    )


def test_decode_rows_carry_time_bandwidth_share_and_reference_ratio(capsys):
    argv = ["bench", "--decode", "--seq", "64", "--heads", "4", "--reps", "1", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["backend"], r["kv_len"]) for r in rows} == {
        (b, t) for b in ("jnp.sum", "reference", "xla_native") for t in (64,)
    }
    for r in rows:
        assert r["ms"] > 0
        sums = [s["ms"] for s in rows if s["backend"] == "jnp.sum" and s["kv_len"] == r["kv_len"]]
        assert r["bandwidth_share"] == pytest.approx(sums[0] / r["ms"])
    assert all(r["vs_reference"] == 1.0 for r in rows if r["backend"] == "reference")

