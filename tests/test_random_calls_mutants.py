"""Mutant backends, each with one classic bug, through the random-call loop of
test_random_calls.py at the top of the ranking, with one persistent cache for
all of them: every one is caught by its probe and no wrong answer reaches the
caller.
"""

from __future__ import annotations

import dataclasses

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import random_calls
from _support import Plugin, make_backend
from attn_backends.probe import prober as _probe

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=45)

#: Random calls per mutant, each of a new signature with the bug's trigger (its
#: forced keyword): each is probed, the mutant refused, the next backend served.
CALLS = 4


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("one-cache-for-every-mutant")


def _dense(call, q, k, v, ops):
    from attn_backend_reference._dense import dense_attention

    return dense_attention(call, q, k, v, ops)


def _ignores_causal(call, q, k, v, ops):
    return _dense(dataclasses.replace(call, causal=False), q, k, v, ops)


def _drops_softcap(call, q, k, v, ops):
    return _dense(dataclasses.replace(call, softcap=None), q, k, v, ops)


def _wrong_head_map(call, q, k, v, ops):
    # Query head h reads kv head h % Hkv instead of h // group.
    k, v = (jnp.tile(x, (1, 1, call.group, 1)) for x in (k, v))
    return _dense(dataclasses.replace(call, kv_heads=call.q_heads), q, k, v, ops)


def _zero_lse(call, q, k, v, ops):
    result = _dense(call, q, k, v, ops)
    return (result[0], jnp.zeros_like(result[1])) if call.return_lse else result


def _lengths_off_by_one(call, q, k, v, ops):
    if ops.kv_lengths is not None:
        ops = ops._replace(kv_lengths=jnp.minimum(ops.kv_lengths + 1, call.kv_len))
    return _dense(call, q, k, v, ops)


def _no_key_gradient(call, q, k, v, ops):
    return _dense(call, q, jax.lax.stop_gradient(k), v, ops)


#: name -> (attend, the kwargs every call of its loop uses, so the bug is met)
MUTANTS = {
    "ignores_causal": (_ignores_causal, {"causal": True}),
    "drops_softcap": (_drops_softcap, {"softcap": 5.0}),
    "wrong_head_map": (_wrong_head_map, {}),
    "zero_lse": (_zero_lse, {"return_lse": True}),
    "lengths_off_by_one": (_lengths_off_by_one, {"kv_lengths": None}),
    "no_key_gradient": (_no_key_gradient, {}),
}


def _forced(rng, force, heads):
    rc = random_calls.draw(rng, heads=heads, grad_share=0.5)
    b, tk = rc.k.shape[0], rc.k.shape[1]
    for name, value in force.items():
        rc.kwargs[name] = (
            rng.integers(0, tk, (b,)).astype(np.int32) if name == "kv_lengths" else value
        )
    return rc


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutants_in_the_same_loop_are_caught(mutant, shared_cache, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(shared_cache))
    attend, force = MUTANTS[mutant]
    bad = make_backend(mutant, priority=1000, attend=attend)
    # Refused, the mutant leaves the call to reference: its probe is the cheapest.
    reg = ab.Registry(plugins=[Plugin(bad)], only=["reference", mutant])
    attention = reg.get(device="cpu", fallback="silent")
    rng = np.random.default_rng(sorted(MUTANTS).index(mutant))
    wrong = []
    # The head-map bug needs two kv heads and a group of two to show.
    heads = (4, 2) if mutant == "wrong_head_map" else None
    for i in range(CALLS):
        rc = _forced(rng, force, heads)
        problems = random_calls.run_one(attention, rc)
        if problems:
            wrong.append(f"#{i} {rc.describe()}: {problems}")
    assert wrong == []  # the mutant never served a wrong answer
    assert _probe.quarantined(mutant), f"{mutant} was never quarantined"
