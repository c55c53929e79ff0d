"""examples/transformer: the same model trains the same on every backend.

Five steps of a smaller configuration of the example from one initialisation
and one batch stream: the losses of every installed cpu backend match those
of flax's own attention step by step, and the loss goes down. The checkpoint
examples/serving loads is trained when missing, loaded when its recipe is the
one asked for, and trained again when stale (no test here trains for it: a
stand-in for ``train`` hands back the baseline's weights).
"""

from __future__ import annotations

import os
from pathlib import Path

import attn_backends as ab
import jax
import numpy as np
import pytest
from _support import load_example

example = load_example("transformer/train.py", "transformer_example")

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


def test_the_learning_rate_warms_up_then_decays_to_a_twentieth() -> None:
    assert example.learning_rate(CFG, 100) == CFG.learning_rate  # constant
    schedule = example.learning_rate(example.Config(learning_rate=2.0, schedule="warmup_cosine"),
                                     100)
    rates = np.asarray(jax.jit(schedule)(np.arange(100)))  # one program, not one per op
    assert rates[0] == 0.0 and rates.max() == rates[10] == 2.0
    assert (np.diff(rates[:11]) > 0).all() and (np.diff(rates[10:]) < 0).all()
    assert rates[-1] == pytest.approx(0.1, rel=0.01)
    with pytest.raises(ValueError, match="'warmup_cosine'.* got 'cosine'"):
        example.learning_rate(example.Config(schedule="cosine"), 10)


def test_a_checkpoint_trains_when_missing_loads_when_current_retrains_when_stale(
        tmp_path, monkeypatch, baseline) -> None:
    path = str(tmp_path / "checkpoints" / "model.npz")
    trained = []

    def stand_in(backend, steps, cfg, registry, log_every):  # train's signature, no training
        trained.append((backend, steps, cfg))
        return example.Run(backend, [9.0 + len(trained)], [], baseline.params)

    monkeypatch.setattr(example, "train", stand_in)

    def weights(cfg=CFG, steps=2):
        return example.trained_params(cfg, steps, path, "reference", REGISTRY)

    assert weights().trained_because == "no checkpoint yet"
    assert trained == [("reference", 2, CFG)]
    loaded = weights()  # the same recipe: loaded, nothing trained
    assert loaded.trained_because is None and len(trained) == 1 and loaded.loss == 10.0
    jax.tree.map(np.testing.assert_array_equal, loaded.params, baseline.params)
    assert jax.tree.structure(loaded.params) == jax.tree.structure(baseline.params)

    stale = weights(steps=3).trained_because
    assert stale == "stale: steps 2 -> 3" and len(trained) == 2
    assert weights(steps=3).trained_because is None  # the stale file was replaced
    other = example.Config(**{**CFG.__dict__, "batch": 2})
    assert weights(other, 3).trained_because == "stale: batch 4 -> 2"
    for name, what in (("CORPUS", "corpus.txt"), ("CODE", "train.py")):
        edited = tmp_path / what
        edited.write_text(Path(getattr(example, name)).read_text(encoding="utf-8") + "\n")
        monkeypatch.setattr(example, name, str(edited))
        assert weights(other, 3).trained_because == f"stale: {what} changed"
    assert len(trained) == 5 and not [f for f in os.listdir(tmp_path / "checkpoints")
                                      if f != "model.npz"], "a partial file was left behind"

    # A file whose recipe matches but whose arrays do not fit the model is an error.
    example.save_checkpoint(path, {"x": np.zeros(1)}, example.recipe(CFG, 2, "reference"), 1.0)
    with pytest.raises(ValueError, match=r"holds no \['blocks'\]\[0\].* delete the file"):
        weights()
