"""Random calls through the registry with one persistent probe cache, as a user lives with it.

Hundreds of random calls (every feature, Tq and Tk from 1 up, lengths down to
0 and 1, GQA, every dtype; some with a quantized K and V, forward only) share
one cache directory across two processes; each result is checked against the
float64 oracle (a quantized K and V dequantized), and no correct backend may
end up quarantined (test_random_calls_mutants.py runs broken backends
through the same loop). ``python tests/random_calls.py --calls 3000`` is the
long version.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attn_backends as ab
import numpy as np
import pytest
import random_calls
from attn_backends.probe import prober as _probe

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=80)

#: Calls per process; two processes share the cache: 120 calls in all over 24
#: signatures. The longest test of make test's main pytest, on both cores at once
#: (the second process runs beside it): 187 s for 300 calls, 134 s for 200.
CALLS = 60
#: Calls per random signature: one verdict serves them (the last at other lengths).
PER_SIGNATURE = 5


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("one-cache-for-every-call")


def test_random_calls_share_one_cache_and_no_correct_backend_is_quarantined(
    shared_cache, monkeypatch
):
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(shared_cache))
    calls = random_calls.draw_many(np.random.default_rng(0), CALLS, PER_SIGNATURE)
    # Some read a quantized K and V (seed 0: int8 and float8_e4m3fn, in bfloat16).
    assert {rc.kv_dtype for rc in calls} > {None}
    # The caller's PYTHONPATH kept after the tests' folder (a checkout run from it).
    path = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(shared_cache),
           "PYTHONPATH": os.pathsep.join(path)}
    # A second process draws other calls into the same cache at the same time.
    other = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "random_calls.py"), "--calls", str(CALLS),
         "--seed", "1", "--per-signature", str(PER_SIGNATURE)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    attention = ab.Registry().get(device="cpu", fallback="silent")
    wrong = []
    for i, rc in enumerate(calls):
        problems = random_calls.run_one(attention, rc)
        if problems:
            wrong.append(f"#{i} {rc.describe()}: {problems}")
    output, _ = other.communicate(timeout=1800)
    assert wrong == []
    assert other.returncode == 0, output[-3000:]
    assert f"{CALLS} calls: 0 wrong answers, 0 quarantined verdicts" in output
    assert _probe.quarantined() == []
    # 24 signatures met, each probed once for the backend that serves it.
    verdicts = len(list((shared_cache / "probes").glob("*.json")))
    assert CALLS // PER_SIGNATURE < verdicts <= 2 * CALLS // PER_SIGNATURE + 10
