"""Core's seams (contract/backend.py): a third party's plugin answers a hook before
core's own, None passes the question on, core's plugins are blockable and
replaceable, and a plugin holding only seams is a plugin, not a problem."""

from __future__ import annotations

import warnings

import attn_backends as ab
import jax.numpy as jnp
import pytest
from _support import Plugin, make_backend

CALL = dict(causal=True)


def _qkv():
    return jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16))


class Refuses:
    """A third party's probe: refuses one backend, says nothing of the others."""

    def __init__(self, name: str):
        self.name, self.asked = name, []

    @ab.hookimpl
    def attn_backends_probe(self, backend, call, platform, options):
        self.asked.append(backend.name)
        return [f"{type(self).__name__} says no"] if backend.name == self.name else None


def test_a_third_partys_answer_comes_first_and_none_passes_the_question_on():
    core_asked = []

    def core(backend, call, platform, options):  # stands in core's Prober's place
        core_asked.append(backend.name)
        return []

    third = Refuses("hi")
    registry = ab.Registry(plugins=[Plugin(make_backend("hi", priority=9),
                                           make_backend("lo", priority=1)), third],
                           autoload=False, probe=core)
    explanation = registry.get(device="cpu", fallback="silent").explain(*_qkv(), **CALL)
    verdicts = {v.backend: v for v in explanation.verdicts}
    assert verdicts["hi"].reasons == ("Refuses says no",)
    assert explanation.chosen == "lo"
    assert third.asked == ["hi", "lo"] and core_asked == ["lo"]


def test_core_plugins_are_blockable_and_named_when_mistyped(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_TUNING", str(tmp_path / "missing.json"))
    registry = ab.Registry(plugins=[Plugin(make_backend("x"))], autoload=False, probe=None,
                           block=["tuning", "parallel"])
    assert registry.features.hook("attn_backends_measured") is None
    assert registry.features.hook("attn_backends_sharded_call") is None
    with pytest.raises(ValueError, match=r"sharding_request|parallel"):
        registry.get(device="cpu", spec=("dp",))
    with pytest.raises(ValueError, match=r"\['tunning'\] are not core plugins; core's are "
                                         r"\['hosts', 'parallel', 'probe', 'tuning'\]"):
        ab.Registry(block=["tunning"])


def test_registering_a_seam_plugin_later_takes_effect_and_discovery_accepts_it():
    registry = ab.Registry(plugins=[Plugin(make_backend("hi", priority=9),
                                           make_backend("lo", priority=1))],
                           autoload=False, probe=None)
    assert registry.get(device="cpu").explain(*_qkv()).chosen == "hi"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PluginWarning for a plugin of seams only
        registry.register(Refuses("hi"))
        chosen = registry.get(device="cpu", fallback="silent").explain(*_qkv()).chosen
    assert chosen == "lo" and registry.problems == []


def test_a_replaced_core_plugin_is_never_loaded(monkeypatch):
    from attn_backends.probe import prober

    def refuse(*args, **kwargs):
        raise AssertionError("core's Prober was built")

    monkeypatch.setattr(prober.Prober, "__init__", refuse)
    registry = ab.Registry(plugins=[Plugin(make_backend("x"))], autoload=False,
                           probe=lambda backend, call, platform, options: [])
    explanation = registry.get(device="cpu").explain(*_qkv())
    assert explanation.chosen == "x" and explanation.verdicts[0].probed
