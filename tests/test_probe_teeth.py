"""The runtime probe has teeth for tiled kernels: it quarantines every xla_native mutant.

The same one-line source edits as the conformance suite's teeth
(``test_conformance_teeth_mutants``), applied in a fresh process; there the
probe runs on one ordinary call (128 tokens, GQA, causal, softcap, float32).
Its canonical call is 77 tokens, which the kernel's default blocks hold in
one tile; the run under ``tile_small_options`` crosses several, which is
where the rescale and accumulator bugs live.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_conformance_teeth_mutants import _LAUNCHER, _ORDER, MUTANTS

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=49)

_CLI_TAIL = "from attn_backends_cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
_PROBE_TAIL = """
import jax, jax.numpy as jnp
import attn_backends as ab
from attn_backends.probe.run import run_probe
backend = ab.Registry(probe=None, only=["xla_native"]).backend("xla_native")
S, f32 = jax.ShapeDtypeStruct, jnp.float32
# A dropout mutant is probed on the same call with dropout (the probe then judges
# under the keep-mask the backend exposes).
dropout = ({"dropout_rate": 0.2, "dropout_key": jax.random.key(3)}
           if os.environ.get("ATTN_TEETH_DROPOUT") else {})
call = ab.bind(S((2, 128, 4, 32), f32), S((2, 128, 2, 32), f32), S((2, 128, 2, 32), f32),
               causal=True, softcap=30.0, **dropout)[0]
print("REASONS " + json.dumps(run_probe(backend, call, "cpu")))
"""
assert _LAUNCHER.endswith(_CLI_TAIL)
_PROBE = _LAUNCHER[: -len(_CLI_TAIL)] + _PROBE_TAIL


def _probe(edits: list, dropout: bool = False) -> list[str]:
    env = dict(os.environ, ATTN_TEETH_EDITS=json.dumps(edits), ATTN_TEETH_ORDER=json.dumps(_ORDER),
               ATTN_TEETH_DROPOUT="1" if dropout else "")
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "MUTANT-STALE" not in log, log[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REASONS "))
    return json.loads(line[len("REASONS "):])


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_the_unmutated_kernel_passes_the_probe(dropout):
    assert _probe([], dropout) == []


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_probe_quarantines_each_mutant(name):
    reasons = _probe(MUTANTS[name][0], dropout=name.startswith("dropout"))
    assert reasons, f"the probe passed the {name} mutant"
    assert all(r.startswith("probe") and "differs from the float64 oracle" in r for r in reasons)
