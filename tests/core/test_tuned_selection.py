"""Selection reading a tuning table (docs/DESIGN.md, "Measured selection"): the
measured winner tried after prefer=, backend= strict, a quarantined, refused or
missing winner skipped, a miss silent, a void table warned once, the table found
through tuning=, ATTN_BACKENDS_TUNING or the cache folder, forward and backward
winners each serving their pass, and the tuned program identical to the pinned one.
Tables are made by `tune` with a scripted timer: no clock is read."""

from __future__ import annotations

import json
import warnings

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import Plugin, dense, make_backend, qkv
from attn_backends.contract.environment import TABLE_NAME
from attn_backends.probe.tuning import TuningWarning, environment, identity
from attn_backends_cli.tune import Signature, tune

Q, K, V = qkv(b=2, tq=8, tk=8, hq=4, hkv=2, d=8)
CALL, _ = ab.bind(Q, K, V, causal=True)


def registry(*backends: ab.Backend) -> ab.Registry:
    return ab.Registry(plugins=[Plugin(*backends)], autoload=False)


def two() -> ab.Registry:
    return registry(make_backend("high", priority=50), make_backend("low", priority=5))


def table(reg: ab.Registry, path, forward: dict[str, float],
          backward: dict[str, float] | None = None):
    """A table timing CALL forward (and backward) with the written-down seconds."""
    signatures = [Signature(CALL)] + ([Signature(CALL, grad=True)] if backward else [])
    times = iter([forward, backward])
    made = None
    for signature in signatures:
        seconds = next(times)

        def timer(name, run, seconds=seconds):
            run()
            return seconds[name]

        made = tune(reg, [signature], "cpu", environment=environment("cpu"),
                    identity=identity(reg.backends), timer=timer, warmup=0, rounds=3, runs=1)
        made.save(path)
    return made


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One table for the module: forward "low" measured 2x faster, forward and
    backward "high"."""
    path = tmp_path_factory.mktemp("tables") / "t.json"
    table(two(), path, forward={"high": 2e-3, "low": 1e-3},
          backward={"high": 1e-3, "low": 2e-3})
    return path


@pytest.fixture
def path(made, tmp_path):
    """A copy of the module's table this test may change."""
    copy = tmp_path / "t.json"
    copy.write_text(made.read_text())
    return copy


def chosen(reg: ab.Registry, **get) -> str:
    return reg.get(device="cpu", fallback="silent", **get).explain(Q, K, V, causal=True).chosen


def test_the_measured_winner_is_chosen_and_explain_says_why(path):
    reg = two()
    assert chosen(reg) == "high"
    explanation = reg.get(device="cpu", tuning=path).explain(Q, K, V, causal=True)
    assert explanation.chosen == "low"
    text = str(explanation)
    assert "tuning: measured: 2.00x faster than high (low 1±0 ms, high 2±0 ms)" in text
    assert str(path) in text
    assert json.loads(explanation.to_json())["measured"]["backend"] == "low"
    # Under jit too, and the answer is the dense one.
    out = jax.jit(lambda q, k, v: reg.get(device="cpu", tuning=path)(q, k, v, causal=True))(
        Q, K, V)
    np.testing.assert_allclose(out, dense(CALL, Q, K, V, ab.Operands()), atol=1e-6)


def test_prefer_wins_over_the_table_and_backend_ignores_it(path):
    reg = two()
    assert chosen(reg, tuning=path, prefer="high") == "high"
    assert chosen(reg, tuning=path, backend="high") == "high"


def test_a_measured_winner_that_is_quarantined_or_refused_is_skipped(path, tmp_path, monkeypatch):
    # The fakes share one module, so their verdicts share a code digest: a fresh
    # cache keeps the good "low"'s probe verdict from speaking for the bad one.
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "fresh"))

    def wrong(call, q, k, v, ops):
        return dense(call, q, k, v, ops) * 1.5

    # Same names, same code (the fakes' module): the entry counts, but "low" now
    # computes wrong answers, or refuses the call.
    for low in (make_backend("low", priority=5, attend=wrong),
                make_backend("low", priority=5, check=lambda call: ["no, not today"])):
        reg = registry(make_backend("high", priority=50), low)
        explanation = reg.get(device="cpu", tuning=path, fallback="silent").explain(
            Q, K, V, causal=True)
        assert explanation.chosen == "high"
        assert "the table's low is not chosen" in str(explanation)


def test_a_miss_is_silent_and_says_so_in_explain(path):
    reg = two()
    q, k, v = qkv(b=2, tq=64, tk=64, hq=4, hkv=2, d=8)  # another shape class
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explanation = reg.get(device="cpu", tuning=path).explain(q, k, v, causal=True)
    assert explanation.chosen == "high"
    assert "no entry for this shape class" in str(explanation)


def test_a_void_table_warns_once_and_selection_uses_the_priority_order(path):
    reg = two()
    data = json.loads(path.read_text())
    data["sections"][0]["environment"]["jax"] = "0.0.1"
    path.write_text(json.dumps(data))
    attention = reg.get(device="cpu", tuning=path)
    with pytest.warns(TuningWarning, match="another environment: jax 0.0.1 then") as caught:
        assert attention.explain(Q, K, V, causal=True).chosen == "high"
        attention.explain(Q, K, V, causal=True)
        reg.get(device="cpu", tuning=path).explain(Q, K, V, causal=True)
    assert len([w for w in caught if issubclass(w.category, TuningWarning)]) == 1


def test_the_table_is_found_through_the_variable_or_the_cache_folder(path, tmp_path, monkeypatch):
    reg = two()
    monkeypatch.setenv("ATTN_BACKENDS_TUNING", str(path))
    assert chosen(reg) == "low"
    monkeypatch.delenv("ATTN_BACKENDS_TUNING")
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(cache))
    assert chosen(reg) == "high"
    cache.mkdir(exist_ok=True)
    (cache / TABLE_NAME).write_text(path.read_text())
    assert chosen(reg) == "low"


def test_a_missing_table_is_refused_naming_how_to_make_one(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no such file; make a table with `attn-backends tune"):
        two().get(tuning=tmp_path / "nope.json")
    monkeypatch.setenv("ATTN_BACKENDS_TUNING", str(tmp_path / "nope.json"))
    with pytest.raises(ab.probe.tuning.TableError, match="ATTN_BACKENDS_TUNING"):
        two().get(device="cpu").explain(Q, K, V, causal=True)


def _scopes(fn, *args) -> set[str]:
    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    return {name for name in ("attn/high", "attn/low") if name in text}


def test_forward_and_backward_winners_each_serve_their_pass(path):
    reg = two()
    attention = reg.get(device="cpu", tuning=path)
    assert attention.explain(Q, K, V, causal=True).chosen == "low"
    assert attention.explain(Q, K, V, causal=True, grad=True).chosen == "high"

    def loss(q, k, v):
        return (attention(q, k, v, causal=True) ** 2).sum()

    assert _scopes(lambda q, k, v: attention(q, k, v, causal=True), Q, K, V) == {"attn/low"}
    assert _scopes(jax.grad(loss, argnums=(0, 1, 2)), Q, K, V) == {"attn/high"}

    def want(q, k, v):
        return (dense(CALL, q, k, v, ab.Operands()) ** 2).sum()

    for got, expected in zip(jax.grad(loss, argnums=(0, 1, 2))(Q, K, V),
                             jax.grad(want, argnums=(0, 1, 2))(Q, K, V), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_tuned_program_is_the_pinned_backends_program(path):
    """The choice is made at trace time: the program is the winner's alone."""
    reg = two()

    def program(**get):
        attention = reg.get(device="cpu", **get)
        return lambda q, k, v: attention(q, k, v, causal=True)

    def text(fn):
        return jax.jit(fn).lower(Q, K, V).as_text()

    assert text(program(tuning=path)) == text(program(backend="low"))
    assert _scopes(program(tuning=path), Q, K, V) == {"attn/low"}


def test_selection_never_times(path, monkeypatch):
    reg = two()
    import time

    for name in ("high", "low"):  # the probes (which keep a time budget) run first
        chosen(reg, backend=name)

    def no_clock():
        raise AssertionError("selection read a clock")

    monkeypatch.setattr(time, "perf_counter", no_clock)
    attention = reg.get(device="cpu", tuning=path)
    assert jnp.isfinite(attention(Q, K, V, causal=True)).all()
