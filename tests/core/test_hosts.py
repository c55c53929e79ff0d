"""Agreement across processes without processes: the rule every process takes
over the offers (attn_backends.parallel.hosts.decide), the single-process path
that never reaches it, and probes that fail for the machine, which never
quarantine on disk. tests/multihost runs real processes."""

from __future__ import annotations

import attn_backends as ab
import pytest
from _support import Plugin, make_backend, qkv
from attn_backends.parallel.hosts import decide
from attn_backends.probe import verdicts
from attn_backends.probe.prober import Prober, environment_failure, probe_key


def offer(process: int, serves: dict[str, str], order: list[str], *, chosen: str | None = None,
          refuses: dict[str, list[str]] | None = None, jax: str = "0.12") -> dict:
    return {"process": process, "host": f"h{process}", "jax": jax, "jaxlib": jax,
            "order": order, "serves": serves, "refuses": refuses or {},
            "chosen": chosen if chosen is not None else next(iter(serves), None)}


def test_the_first_backend_in_process_0s_order_that_all_serve_is_chosen():
    offers = [offer(1, {"b": "1", "c": "1"}, ["c", "b", "a"], chosen="c",
                    refuses={"a": ["wrong"]}),
              offer(0, {"a": "1", "b": "1", "c": "1"}, ["a", "b", "c"])]
    decision = decide(offers)
    assert decision.chosen == "b"
    assert decision.refused["a"] == ("process 1 (h1) refuses it: wrong",)
    assert decision.overruled
    assert "process 0 (h0) would choose a" in decision.note
    assert "process 1 (h1) would choose c" in decision.note


def test_offers_are_judged_in_process_order_whatever_order_they_arrive_in():
    a = [offer(0, {"x": "1", "y": "1"}, ["x", "y"]), offer(1, {"x": "1", "y": "1"}, ["y", "x"])]
    assert decide(a).chosen == decide(a[::-1]).chosen == "x"


def test_a_backend_at_two_versions_or_missing_somewhere_is_not_served_by_all():
    offers = [offer(0, {"x": "1", "y": "1"}, ["x", "y"]),
              offer(1, {"x": "2"}, ["x"])]
    decision = decide(offers)
    assert decision.chosen is None
    assert "different versions" in decision.refused["x"][0]
    assert "does not have it" in decision.refused["y"][0]
    assert "no backend is served by all 2 processes" in decision.note
    assert "process 1 (h1) serves x 2" in decision.note


def test_different_jax_versions_are_refused_before_any_backend():
    decision = decide([offer(0, {"x": "1"}, ["x"]), offer(1, {"x": "1"}, ["x"], jax="0.10")])
    assert decision.chosen is None and "different jax versions" in decision.note


def test_one_process_never_builds_the_agreement(monkeypatch):
    def refuse():
        raise AssertionError("the single-process path reached the agreement")

    monkeypatch.setattr(ab._wiring, "host_agreement", refuse)
    registry = ab.Registry(plugins=[Plugin(make_backend("x", priority=5))], autoload=False)
    q, k, v = qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8)
    explanation = registry.get(device="cpu").explain(q, k, v)
    assert explanation.chosen == "x" and explanation.agreement is None
    assert "hosts:" not in str(explanation)


@pytest.mark.parametrize(("exc", "environment"), [
    (RuntimeError("Fetching value for `jax.Array` that spans non-addressable devices"), True),
    (type("JaxRuntimeError", (RuntimeError,), {})("RESOURCE_EXHAUSTED: out of memory"), True),
    (type("JaxRuntimeError", (RuntimeError,), {})("INTERNAL: Mosaic failed"), False),
    (ValueError("shapes do not match"), False),
])
def test_what_counts_as_the_machines_failure(exc, environment):
    assert environment_failure(exc) is environment


def test_a_probe_the_machine_could_not_run_is_never_quarantined_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path))
    backend = make_backend("x", priority=5)
    q, k, v = qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8)
    call, _ = ab.bind(q, k, v)

    def unreachable(*_):
        raise RuntimeError("Fetching value for `jax.Array` that spans non-addressable devices")

    verdict = Prober(runner=unreachable).verdict(backend, call, "cpu")
    assert not verdict.passed and verdict.source == "environment"
    assert "not quarantined on disk" in verdict.reasons[0]
    assert verdicts.read(probe_key(backend, call, "cpu")) is None

    # A backend that raises for itself is quarantined on disk, as before.
    def broken(*_):
        raise ValueError("shapes do not match")

    assert Prober(runner=broken).verdict(backend, call, "cpu").source == "run"
    assert not verdicts.read(probe_key(backend, call, "cpu"))["passed"]
