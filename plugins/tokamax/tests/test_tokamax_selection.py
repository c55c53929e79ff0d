"""Selection across libraries: `attn-backends tune` measures ours against tokamax's on
the same calls and selection replays the winner; the serving example runs on a
tokamax backend by name, decoding what the default backend decodes. Which backend
wins is the machine's business: only that the table holds both libraries and that
selection follows it."""

from __future__ import annotations

import json
import re

import attn_backends as ab
import pytest
from _support import load_example
from attn_backends_cli.main import main

QUICK = ["--rounds", "1", "--runs", "1", "--warmup", "1"]
CALL = ["--q", "1,8,2,8", "--kv", "1,8,1,8", "--causal"]
ONLY = "xla_native,tokamax_xla"


@pytest.fixture(autouse=True)
def ours_and_tokamax(monkeypatch, tmp_path):
    import attn_backends

    monkeypatch.setenv("ATTN_BACKENDS_ONLY", ONLY)
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    registry = attn_backends.Registry()
    monkeypatch.setattr(attn_backends.choose.registry, "registry", registry)
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


def test_the_serving_example_on_tokamax_xla_decodes_what_the_default_backend_does():
    # `serve.py --backend tokamax_xla` is this Engine, on a smaller model of the
    # same code (untrained: the tokens only have to agree); the default under
    # ATTN_BACKENDS_ONLY is xla_native. A chunk budget of 4 keeps every step in
    # one row bucket (8 rows): one compiled step per engine.
    serve = load_example("serving/serve.py", "serving_example")
    _, vocab = serve.transformer.load_corpus()
    cfg = serve.transformer.Config(d_model=32, heads=4, kv_heads=2, layers=1, seq=32)
    params = serve.transformer.init_state(cfg, vocab)
    requests = serve.demo_requests(lengths=(3, 9, 5), max_new=3)
    registry = ab.Registry(probe=None)
    engines = {name: serve.Engine(params, vocab, cfg=cfg, num_pages=12, chunk_budget=4,
                                  device="cpu", backend=name, registry=registry)
               for name in (None, "tokamax_xla")}
    assert [e.backend for e in engines.values()] == ["xla_native", "tokamax_xla"]
    default, tokamax = (engine.run(requests) for engine in engines.values())
    assert tokamax == default
    # Prefill chunks and decode rows both ran through tokamax's paged path.
    assert {n > 1 for rec in engines["tokamax_xla"].records for _, _, n in rec.work} == {
        True, False}
