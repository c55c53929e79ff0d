"""examples/transformer: the same model trains the same on every backend.

Five steps of a smaller configuration of the example from one initialisation
and one batch stream: the losses of every installed cpu backend match those
of flax's own attention step by step, and the loss goes down.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import attn_backends as ab
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "transformer", "train.py")
_spec = importlib.util.spec_from_file_location("transformer_example", _PATH)
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example  # its dataclasses look their module up
_spec.loader.exec_module(example)

# Smaller than the example's defaults, same code: this runs in CI.
CFG = example.Config(d_model=64, heads=4, kv_heads=2, layers=1, seq=32, batch=4)
REGISTRY = ab.Registry(probe=None)
BACKENDS = [b for b in ("reference", "xla_native", "example_dense") if b in REGISTRY.backends]


@pytest.fixture(scope="module")
def baseline():
    return example.train("flax", 5, CFG, REGISTRY)


@pytest.mark.parametrize("backend", BACKENDS)
def test_losses_match_flax_attention_and_decrease(backend: str, baseline) -> None:
    run = example.train(backend, 5, CFG, REGISTRY)
    np.testing.assert_allclose(run.losses, baseline.losses, rtol=1e-4)
    assert run.losses[-1] < run.losses[0] - 0.3, run.losses


def test_training_with_a_tuning_table_reports_both_runs(tmp_path) -> None:
    """The registry's choice, untuned and tuned: a table is made from the step's
    own attention calls (forward and backward), both runs train the same."""
    import json

    table = tmp_path / "table.json"
    untuned, tuned = example.compare_tuned(str(table), 4, CFG, REGISTRY, rounds=2)
    (section,) = json.loads(table.read_text())["sections"]
    (entry,) = section["entries"]
    assert entry["shape_class"]["grad"] is True
    assert entry["shape_class"]["causal"] is True
    assert entry["shape_class"]["q_len"] == CFG.seq
    assert len(untuned.step_seconds) == len(tuned.step_seconds) == 3
    np.testing.assert_allclose(tuned.losses, untuned.losses, rtol=1e-4)
