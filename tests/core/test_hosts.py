"""Agreement across processes without processes: the rule every process takes
over the offers (attn_backends.parallel.hosts.decide), the single-process path
that never reaches it, and probes that fail for the machine, which never
quarantine on disk. tests/multihost runs real processes."""

from __future__ import annotations

import threading
import warnings

import attn_backends as ab
import pytest
from _support import Plugin, make_backend, qkv
from attn_backends.choose.select import Judging, select
from attn_backends.contract.errors import AgreementWarning
from attn_backends.parallel.hosts import Hosts, decide
from attn_backends.probe import verdicts
from attn_backends.probe.prober import Prober, environment_failure, probe_key


def offer(process: int, serves: dict[str, str], order: list[str], *, chosen: str | None = None,
          refuses: dict[str, list[str]] | None = None, deferred: dict[str, str] | None = None,
          jax: str = "0.12") -> dict:
    return {"process": process, "host": f"h{process}", "jax": jax, "jaxlib": jax,
            "order": order, "serves": serves, "deferred": deferred or {},
            "refuses": refuses or {},
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


def test_the_first_candidate_deferred_somewhere_is_pending_not_chosen():
    # Process 1 refuses a; b is the candidate, and process 0 deferred its probe.
    offers = [offer(0, {"a": "1"}, ["a", "b", "c"], deferred={"b": "1", "c": "1"}),
              offer(1, {"b": "1"}, ["a", "b", "c"], refuses={"a": ["probe: wrong"]},
                    deferred={"c": "1"})]
    decision = decide(offers)
    assert decision.chosen is None and decision.pending == "b"
    # Once probed there, b is served by all; c, deferred by both, is never asked for.
    offers[0] = offer(0, {"a": "1", "b": "1"}, ["a", "b", "c"], deferred={"c": "1"})
    decision = decide(offers)
    assert decision.chosen == "b" and decision.pending is None
    assert "process 0 (h0) would choose a" in decision.note
    # A deferred backend at another version is refused without a probe.
    decision = decide([offer(0, {"a": "1"}, ["a", "b"], deferred={"b": "1"}),
                       offer(1, {"b": "2"}, ["b", "a"], refuses={"a": ["wrong"]})])
    assert decision.chosen is None and decision.pending is None
    assert "different versions" in decision.refused["b"][0]
    assert "process 0 (h0) serves a 1 (not probed: b)" in decision.note


class Store:
    """JAX's coordination store, in memory, shared by the threads playing processes."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def key_value_try_get(self, key: str) -> str:
        with self.changed:
            return self.values[key]

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _agree_in_threads(failing: list[set[str]], names: list[str], probe_all: bool = False):
    """Each process (a thread) selects among ``names`` (ranked in that order) with a
    probe that fails those in its ``failing``, and agrees with the others through
    one Store: each process's choice and the backends it probed, in order."""
    backends = [make_backend(name, priority=len(names) - i) for i, name in enumerate(names)]
    call, _ = ab.bind(*qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8))
    store, results = Store(), [None] * len(failing)

    def process(i: int) -> None:
        probed: list[str] = []

        def probe(backend, call, platform, options):  # its verdicts cached, as the Prober's
            if backend.name not in probed:
                probed.append(backend.name)
            return ["probe: wrong"] if backend.name in failing[i] else []

        def judge(probe_also=frozenset()):
            also = set(names) if probe_all else probe_also
            return select(call, "cpu", backends,
                          Judging(jax_version="0.12", probe=probe, probe_also=also))

        hosts = Hosts(store=store, process=i, count=len(failing), timeout_s=10)
        results[i] = (hosts(judge(), ("q",), judge).chosen, probed)

    threads = [threading.Thread(target=process, args=(i,)) for i in range(len(failing))]
    with warnings.catch_warnings():  # the filters are global: the threads see this one
        warnings.simplefilter("ignore", AgreementWarning)  # process 0 overrules others
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return results


@pytest.mark.parametrize("failing", [
    [set(), set()],                      # all serve the first: no step, one probe each
    [set(), {"a"}],                      # process 1 refuses a: b is probed on process 0 too
    [{"b"}, {"a"}],                      # a and b refused somewhere: c
    [{"a", "b"}, set(), {"c"}],          # three processes: d
    [{"a", "b", "c", "d"}, set()],       # none served by all
])
def test_agreeing_with_deferred_probes_chooses_what_probing_all_would(failing):
    names = ["a", "b", "c", "d"]
    lazy = _agree_in_threads(failing, names)
    everything = _agree_in_threads(failing, names, probe_all=True)
    assert [chosen for chosen, _ in lazy] == [chosen for chosen, _ in everything]
    chosen = lazy[0][0]
    served = [n for n in names if not any(n in f for f in failing)]
    assert chosen == (served[0] if served else None)
    # Each process probed only what it would alone and what the rule reached.
    reached = names[:names.index(chosen) + 1] if chosen else names
    for (_, probed), fails in zip(lazy, failing, strict=True):
        alone = next(n for n in names if n not in fails) if len(fails) < len(names) else None
        assert set(probed) <= set(reached) | {alone}, probed
    if chosen is not None:
        assert all(chosen in probed for _, probed in lazy)


def test_different_jax_versions_are_refused_before_any_backend():
    decision = decide([offer(0, {"x": "1"}, ["x"]), offer(1, {"x": "1"}, ["x"], jax="0.10")])
    assert decision.chosen is None and "different jax versions" in decision.note


def test_one_process_never_builds_the_agreement(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the single-process path reached the agreement")

    monkeypatch.setattr(ab.parallel.hosts.Hosts, "__init__", refuse)
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
