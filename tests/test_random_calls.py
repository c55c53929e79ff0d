"""Random calls through the registry with one persistent probe cache, as a user lives with it.

Hundreds of random calls (every feature, Tq and Tk from 1 up, lengths down to
0 and 1, GQA, every dtype) share one cache directory across two processes;
each result is checked against the float64 oracle, and no correct backend may
end up quarantined. Then mutant backends, each with one classic bug, go
through the same loop at the top of the ranking: every one is caught by its
probe and no wrong answer reaches the caller. ``python tests/random_calls.py
--calls 3000`` is the long version.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import random_calls
from _support import Plugin, make_backend

import attn_backends as ab
from attn_backends import _probe

#: Calls per process; two processes share the cache: 300 calls in all.
CALLS = 150
#: Calls per random signature: one verdict serves them (the last at other lengths).
PER_SIGNATURE = 5


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("one-cache-for-every-call")


def test_random_calls_share_one_cache_and_no_correct_backend_is_quarantined(shared_cache, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(shared_cache))
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(shared_cache),
           "PYTHONPATH": str(Path(__file__).parent)}
    # A second process draws other calls into the same cache at the same time.
    other = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "random_calls.py"), "--calls", str(CALLS),
         "--seed", "1", "--per-signature", str(PER_SIGNATURE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    attention = ab.Registry().get(device="cpu", fallback="silent")
    wrong = []
    for i, rc in enumerate(random_calls.draw_many(np.random.default_rng(0), CALLS, PER_SIGNATURE)):
        problems = random_calls.run_one(attention, rc)
        if problems:
            wrong.append(f"#{i} {rc.describe()}: {problems}")
    output, _ = other.communicate(timeout=1800)
    assert wrong == []
    assert other.returncode == 0, output[-3000:]
    assert f"{CALLS} calls: 0 wrong answers, 0 quarantined verdicts" in output
    assert _probe.quarantined() == []
    # 60 signatures met, each probed once for the backend that serves it.
    verdicts = len(list((shared_cache / "probes").glob("*.json")))
    assert 20 < verdicts <= 2 * CALLS // PER_SIGNATURE + 10


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
        rc.kwargs[name] = rng.integers(0, tk, (b,)).astype(np.int32) if name == "kv_lengths" else value
    return rc


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutants_in_the_same_loop_are_caught(mutant, shared_cache, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(shared_cache))
    attend, force = MUTANTS[mutant]
    bad = make_backend(mutant, priority=1000, attend=attend)
    reg = ab.Registry(plugins=[Plugin(bad)], only=["reference", "xla_native", mutant])
    attention = reg.get(device="cpu", fallback="silent")
    rng = np.random.default_rng(sorted(MUTANTS).index(mutant))
    wrong = []
    # The head-map bug needs two kv heads and a group of two to show.
    heads = (4, 2) if mutant == "wrong_head_map" else None
    for i in range(12):
        rc = _forced(rng, force, heads)
        problems = random_calls.run_one(attention, rc)
        if problems:
            wrong.append(f"#{i} {rc.describe()}: {problems}")
    assert wrong == []  # the mutant never served a wrong answer
    assert _probe.quarantined(mutant), f"{mutant} was never quarantined"
