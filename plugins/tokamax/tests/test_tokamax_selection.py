"""Selection across libraries: `attn-backends tune` measures ours against tokamax's on
the same calls and selection replays the winner; the serving example says why a
tokamax backend cannot serve it. Which backend wins is the machine's business:
only that the table holds both libraries and that selection follows it."""

from __future__ import annotations

import json
import re

import attn_backends as ab
import jax.numpy as jnp
import pytest
from attn_backends.cli.main import main

QUICK = ["--rounds", "1", "--runs", "1", "--warmup", "1"]
CALL = ["--q", "1,8,2,8", "--kv", "1,8,1,8", "--causal"]
ONLY = "xla_native,tokamax_xla"


@pytest.fixture(autouse=True)
def ours_and_tokamax(monkeypatch, tmp_path):
    import attn_backends

    monkeypatch.setenv("ATTN_BACKENDS_ONLY", ONLY)
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    registry = attn_backends.Registry()
    monkeypatch.setattr(attn_backends._wiring, "registry", registry)
    monkeypatch.setattr(attn_backends, "registry", registry)


def test_tune_measures_ours_and_tokamax_and_selection_replays_the_winner(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["tune", "--device", "cpu", *CALL, *QUICK, "--out", str(out)]) == 0
    (section,) = json.loads(out.read_text())["sections"]
    (entry,) = section["entries"]
    assert set(entry["candidates"]) == set(ONLY.split(","))
    assert entry["default"] == "xla_native"
    for measured in entry["candidates"].values():
        assert measured["median_s"] > 0
    capsys.readouterr()
    assert main(["explain", "--device", "cpu", *CALL, "--tuning", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"table {out}" in text
    assert re.search(rf"^\s+{entry['winner']}\s+prio\s+\d+\s+CHOSEN$", text, re.M), text


def test_the_serving_example_refuses_a_tokamax_backend_with_the_reason():
    from attn_backends import UnsupportedError

    registry = ab.Registry(probe=None)
    with pytest.raises((UnsupportedError, ab.NoBackendError)) as raised:
        registry.get_paged(device="cpu", backend="tokamax_xla", num_q_heads=4, num_kv_heads=2,
                           head_dim=16, page_size=16, dtype=jnp.float32)
    assert "tokamax_xla" in str(raised.value)
