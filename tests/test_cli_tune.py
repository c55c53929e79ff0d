"""`attn-backends tune` and `explain --tuning`, with the installed reference and
xla_native backends and the real clock: only the structure of what is written
is checked (which backend wins is the machine's business), and the traced
program's calls found by `signatures_of`."""

from __future__ import annotations

import json

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from attn_backends_cli.main import main
from attn_backends_cli.tune import signatures_of

QUICK = ["--rounds", "1", "--runs", "1", "--warmup", "1"]
CALL = ["--q", "2,8,4,8", "--kv", "2,8,2,8", "--causal"]


@pytest.fixture(autouse=True)
def two_backends(monkeypatch, tmp_path):
    import attn_backends

    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "reference,xla_native")
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    registry = attn_backends.Registry()
    monkeypatch.setattr(attn_backends.choose.registry, "registry", registry)
    # The package's name for it too: a test reading ab.registry would otherwise
    # make the process's registry discover under this ATTN_BACKENDS_ONLY and keep
    # that for every later test of the worker.
    monkeypatch.setattr(attn_backends, "registry", registry)


def test_tune_writes_a_table_that_explain_reads(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["tune", "--device", "cpu", *CALL, "--both", *QUICK, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"tuning table written to {out}" in err
    (section,) = json.loads(out.read_text())["sections"]
    assert section["environment"]["platform"] == "cpu"
    assert sorted(e["shape_class"]["grad"] for e in section["entries"]) == [False, True]
    for entry in section["entries"]:
        assert set(entry["candidates"]) == {"reference", "xla_native"}
        assert entry["default"] == "xla_native"
        assert entry["winner"] in ("reference", "xla_native")
        for measured in entry["candidates"].values():
            assert measured["median_s"] > 0 and measured["compile_s"] > 0
            assert measured["backend"] and measured["core"] and measured["version"]
    assert main(["explain", "--device", "cpu", *CALL, "--tuning", str(out)]) == 0
    assert f"table {out}" in capsys.readouterr().out


def test_tune_without_out_writes_the_cache_table_selection_reads(tmp_path, capsys):
    assert main(["tune", "--device", "cpu", *CALL, *QUICK]) == 0
    assert (tmp_path / "cache" / "tuning.json").is_file()
    assert main(["explain", "--device", "cpu", *CALL]) == 0
    assert "tuning: " in capsys.readouterr().out


def test_tune_reads_calls_from_a_file(tmp_path, capsys):
    calls = tmp_path / "calls.txt"
    calls.write_text("# the model's two attention shapes\n"
                     "--q 2,8,4,8 --kv 2,8,2,8 --causal\n\n"
                     "--q 1,1,4,8 --kv 1,64,2,8 --kv-lengths --grad  # decode\n")
    out = tmp_path / "t.json"
    assert main(["tune", "--device", "cpu", "--from", str(calls), *QUICK, "--out", str(out)]) == 0
    (section,) = json.loads(out.read_text())["sections"]
    shapes = sorted((e["shape_class"]["q_len"], e["shape_class"]["grad"])
                    for e in section["entries"])
    assert shapes == [(1, True), (8, False)]


def test_bad_input_is_a_message(tmp_path, capsys):
    assert main(["tune", "--device", "cpu", *QUICK]) == 2
    assert "no call to tune: give --q and --kv" in capsys.readouterr().err
    bad = tmp_path / "calls.txt"
    bad.write_text("--q 2,8 --kv 2,8,2,8\n")
    assert main(["tune", "--device", "cpu", "--from", str(bad)]) == 2
    assert f"{bad}:1: not a call in tune's flags" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--margin", "-1", *CALL])
    assert "argument --margin: expected a fraction > 0" in capsys.readouterr().err


def test_signatures_of_a_traced_program_are_its_calls_once_each():
    attention = ab.registry.get(device="cpu")
    x = jnp.ones((2, 16, 4, 8))
    kv = jnp.ones((2, 16, 2, 8))

    def step(x, kv):
        y = attention(x, kv, kv, causal=True)
        y = attention(y, kv, kv, causal=True)  # the same call again
        return attention(y[:, :1], kv, kv).sum()

    signatures = signatures_of(jax.grad(step), x, kv)
    assert [(s.call.q_len, s.call.causal, s.grad) for s in signatures] == [
        (16, True, False), (16, True, True), (1, False, False), (1, False, True)]


def test_list_says_what_counts_in_the_table_and_what_is_void(tmp_path, capsys, monkeypatch):
    out = tmp_path / "table.json"
    assert main(["tune", "--device", "cpu", *CALL, *QUICK, "--out", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    data["sections"][0]["entries"][0]["candidates"]["reference"]["backend"] = "0ld"
    data["sections"].append({**data["sections"][0], "environment": {
        **data["sections"][0]["environment"], "device_kind": "TPU v5e"}})
    out.write_text(json.dumps(data))
    monkeypatch.setenv("ATTN_BACKENDS_TUNING", str(out))
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["tuning"]
    assert f"tuning table {out}: 0 entries count on cpu, 1 reasons void others, 1 measured " \
        "elsewhere" in text
    assert "void: reference's backend digest changed (0ld then" in text
    assert listed["counting"] == 0 and listed["other_environments"] == 1
