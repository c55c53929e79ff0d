"""A small decoder-only transformer in flax nnx, trained on corpus.txt through the registry.

Every attention layer is ``nnx.MultiHeadAttention`` with
``attention_fn=attn_backends_flax.attention_fn(...)``: the model code is the
same whichever backend serves it. ``train(backend, steps)`` trains from one
fixed initialisation on one fixed stream of batches, so the loss curves of
different backends can be compared step by step; ``backend="flax"`` runs
flax's own attention, the baseline.

    python examples/transformer/train.py --backend xla_native --steps 300
    python examples/transformer/train.py --tune table.json --steps 50   # tuned vs priority
    python examples/transformer/train.py --serving   # the model examples/serving serves

``--serving`` trains ``SERVING`` for ``SERVING_STEPS`` steps into a checkpoint
(``checkpoints/serving.npz`` beside this file, not tracked by git), which
examples/serving loads. A checkpoint holds the recipe its weights came from
(the config, the step count, the backend, and SHA-256 digests of corpus.txt and
of this file); one whose recipe differs from the one asked for is stale and is
trained again, saying what changed.

Character-level; 2 query heads over 1 kv head (MQA), head dim 64 so that
flash_pallas can serve it too; causal self-attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import optax
from attn_backends_flax import attention_fn
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus.txt")
CODE = os.path.abspath(__file__)  # a checkpoint's weights depend on this file's code
#: How the learning rate moves over a run: Adam's constant rate, or a linear
#: warm-up over the first tenth of the steps and a cosine down to a twentieth.
SCHEDULES = ("constant", "warmup_cosine")


@dataclass(frozen=True)
class Config:
    """Model and training sizes; the defaults train in a few minutes on 2 CPU cores."""

    d_model: int = 128
    heads: int = 2
    kv_heads: int = 1
    layers: int = 2
    seq: int = 64
    batch: int = 8
    learning_rate: float = 3e-3
    schedule: str = "constant"  # one of SCHEDULES
    seed: int = 0


#: The model examples/serving serves: the architecture above, 32 positions (a
#: prompt and its new tokens), trained on batches of 32 with a decaying rate
#: until its greedy completions read like the corpus (loss about 0.7; the run,
#: compiling included, takes about 25 s of cpu time).
SERVING = Config(seq=32, batch=32, learning_rate=4e-3, schedule="warmup_cosine")
SERVING_STEPS = 300
SERVING_CHECKPOINT = os.path.join(HERE, "checkpoints", "serving.npz")


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP: x ``[B, T, d_model]`` -> same."""

    def __init__(self, cfg: Config, attention: Callable[..., jax.Array], rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, in_features=cfg.d_model,
            decode=False, attention_fn=attention, rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, 4 * cfg.d_model, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), is_causal=True)
        return self.feed_forward(x)

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """The MLP half of the block, residual included: x ``[..., d_model]`` -> same.
        Its own method so that examples/serving can run the attention half its way."""
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Model(nnx.Module):
    """tokens ``[B, T]`` int32 -> logits ``[B, T, vocab]``."""

    def __init__(self, cfg: Config, vocab: int, attention: Callable[..., jax.Array],
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, cfg.d_model, rngs=rngs)
        self.position = nnx.Embed(cfg.seq, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attention, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def load_corpus() -> tuple[np.ndarray, int]:
    """corpus.txt as int32 character ids, and the vocabulary size."""
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], np.int32), len(chars)


def batches(data: np.ndarray, cfg: Config, steps: int) -> np.ndarray:
    """``[steps, batch, seq + 1]`` windows of data, the same for every backend."""
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(data) - cfg.seq - 1, size=(steps, cfg.batch))
    return data[starts[..., None] + np.arange(cfg.seq + 1)]


def attention_for(backend: str, registry: attn_backends.Registry,
                  tuning: str | None = None) -> Callable[..., jax.Array]:
    """flax's own attention for ``"flax"``; the registry's choice on cpu for
    ``"auto"`` (its priority order, or the tuning table ``tuning``); else the
    adapter over that backend on cpu."""
    if backend == "flax":
        return nnx.dot_product_attention
    if backend == "auto":
        return attention_fn(registry.get(device="cpu", tuning=tuning))
    return attention_fn(registry.get(device="cpu", backend=backend))


@functools.cache
def init_state(cfg: Config, vocab: int) -> nnx.State:
    """The model's parameters, one program for every initialiser, the same for every backend."""

    @nnx.jit
    def create() -> Model:
        return Model(cfg, vocab, nnx.dot_product_attention, nnx.Rngs(cfg.seed))

    return nnx.state(create(), nnx.Param)


@dataclass
class Trainer:
    """A jitted training step for one backend: ``step(params, opt_state, batch)``."""

    step: Any
    params: nnx.State
    opt_state: Any


def learning_rate(cfg: Config, steps: int) -> float | optax.Schedule:
    """``cfg.learning_rate`` shaped by ``cfg.schedule`` over a run of ``steps`` steps."""
    if cfg.schedule == "constant":
        return cfg.learning_rate
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, steps // 10, steps, cfg.learning_rate / 20)
    raise ValueError(f"Config.schedule: expected one of {SCHEDULES}, got {cfg.schedule!r}")


def trainer(
    backend: str, cfg: Config, vocab: int, params: nnx.State, registry: attn_backends.Registry,
    tuning: str | None = None, steps: int = 1,
) -> Trainer:
    """The step function for ``backend`` (its own model graph, the shared parameters),
    its optimizer's schedule spanning ``steps`` steps."""
    attention = attention_for(backend, registry, tuning)
    abstract = nnx.eval_shape(lambda: Model(cfg, vocab, attention, nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract, nnx.Param)
    tx = optax.adam(learning_rate(cfg, steps))

    def loss_fn(params: nnx.State, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def step(params: nnx.State, opt_state: Any, batch: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return Trainer(step, params, tx.init(params))


@dataclass
class Run:
    """One backend's training run: loss per step, seconds per step (after the first),
    and the trained parameters (``train`` only)."""

    backend: str
    losses: list[float]
    step_seconds: list[float]
    params: nnx.State | None = None


def train(backend: str, steps: int, cfg: Config = Config(),
          registry: attn_backends.Registry | None = None, log_every: int = 0) -> Run:
    """Train ``steps`` steps with ``backend`` from the shared initialisation and batches;
    with ``log_every``, a progress line every ``log_every`` steps and at the last."""
    data, vocab = load_corpus()
    registry = registry if registry is not None else attn_backends.registry
    t = trainer(backend, cfg, vocab, init_state(cfg, vocab), registry, steps=steps)
    params, opt_state = t.params, t.opt_state
    losses, seconds = [], []
    began = time.perf_counter()
    for i, batch in enumerate(batches(data, cfg, steps)):
        start = time.perf_counter()
        params, opt_state, loss = t.step(params, opt_state, jnp.asarray(batch))
        losses.append(float(loss))  # float() waits for the step
        seconds.append(time.perf_counter() - start)
        if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
            print(f"  step {i + 1:4d}/{steps}  loss {losses[-1]:.4f}  "
                  f"{time.perf_counter() - began:5.1f} s", flush=True)
    return Run(backend, losses, seconds[1:], params)


def recipe(cfg: Config, steps: int, backend: str) -> dict[str, Any]:
    """What ``train(backend, steps, cfg)``'s weights depend on: its arguments and
    the bytes of the corpus and of the code (SHA-256)."""

    def digest(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    return {"config": dataclasses.asdict(cfg), "steps": steps, "backend": backend,
            "corpus_sha256": digest(CORPUS), "code_sha256": digest(CODE)}


def changes(found: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's recipe and the one wanted, in words;
    None when they are the same."""
    words = {"corpus_sha256": "corpus.txt changed", "code_sha256": "train.py changed"}
    said = []
    for key in sorted(set(found) | set(wanted)):
        if found.get(key) == wanted.get(key):
            continue
        if key == "config":
            old, new = found.get(key) or {}, wanted[key]
            said += [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                     if old.get(k) != new.get(k)]
        else:
            said.append(words.get(key, f"{key} {found.get(key)!r} -> {wanted.get(key)!r}"))
    return "; ".join(said) or None


@dataclass
class Weights:
    """Trained parameters, the recipe they came from, the last step's loss, and why
    they were trained now (None: loaded from their checkpoint)."""

    params: nnx.State
    recipe: dict[str, Any]
    loss: float
    trained_because: str | None


def save_checkpoint(path: str, params: nnx.State, recipe: dict[str, Any], loss: float) -> None:
    """``params`` (each array under its path in the state), ``recipe`` and ``loss`` as
    one ``.npz``, written whole or not at all (a stopped run leaves no half file)."""
    arrays = {jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        np.savez(f, __recipe__=np.array(json.dumps(recipe, sort_keys=True)),
                 __loss__=np.array(loss), **arrays)
    os.replace(partial, path)


def _params_from(saved: Any, path: str, cfg: Config, vocab: int) -> nnx.State:
    """The model's parameters from an opened checkpoint, each checked against the
    model's own shape."""
    abstract = nnx.state(nnx.eval_shape(
        lambda: Model(cfg, vocab, nnx.dot_product_attention, nnx.Rngs(0))), nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    arrays = []
    for p, want in leaves:
        name = jax.tree_util.keystr(p)
        got = saved[name] if name in saved.files else None
        if got is None or got.shape != want.shape:
            raise ValueError(
                f"{path}: its recipe matches, yet it holds {'no' if got is None else got.shape} "
                f"{name} where the model has {want.shape}; delete the file to train it again")
        arrays.append(jnp.asarray(got))
    return jax.tree_util.tree_unflatten(treedef, arrays)


def trained_params(cfg: Config, steps: int, path: str, backend: str = "xla_native",
                   registry: attn_backends.Registry | None = None, log_every: int = 0) -> Weights:
    """What ``train(backend, steps, cfg)`` trains: loaded from the checkpoint at
    ``path`` when its recipe is this one, else trained now (progress every
    ``log_every`` steps) and saved there, replacing a stale one."""
    wanted = recipe(cfg, steps, backend)
    because = "no checkpoint yet"
    if os.path.exists(path):
        with np.load(path, allow_pickle=False) as saved:
            if "__recipe__" not in saved.files:
                raise ValueError(f"{path} is no checkpoint of this example (no recipe in it): "
                                 "name another path, or delete it")
            found = json.loads(str(saved["__recipe__"]))
            stale = changes(found, wanted)
            if stale is None:
                params = _params_from(saved, path, cfg, load_corpus()[1])
                return Weights(params, wanted, float(saved["__loss__"]), None)
            because = f"stale: {stale}"
    print(f"training {os.path.relpath(path)} ({because}): {steps} steps, {backend}", flush=True)
    run = train(backend, steps, cfg, registry, log_every)
    save_checkpoint(path, run.params, wanted, run.losses[-1])
    return Weights(run.params, wanted, run.losses[-1], because)


def compare_tuned(table: str, steps: int, cfg: Config = Config(),
                  registry: attn_backends.Registry | None = None,
                  rounds: int = 7) -> tuple[Run, Run]:
    """The registry's choice trained untuned and with a tuning table, in this process.

    The table is made first (when ``table`` does not exist) from the attention
    calls the training step makes, each timed forward and backward. The two
    runs then take their steps in turn on the same batches, so load on the
    machine falls on both alike.
    """
    from attn_backends.probe.tuning import environment, identity
    from attn_backends_cli.tune import signatures_of, tune

    data, vocab = load_corpus()
    registry = registry if registry is not None else attn_backends.registry
    params = init_state(cfg, vocab)
    untuned = trainer("auto", cfg, vocab, params, registry, steps=steps)
    first = jnp.asarray(batches(data, cfg, 1)[0])
    if not os.path.exists(table):
        found = signatures_of(untuned.step, untuned.params, untuned.opt_state, first,
                              passes=(True,))
        tune(registry, found, "cpu", environment=environment("cpu"),
             identity=identity(registry.backends), rounds=rounds).save(table)
    tuned = trainer("auto", cfg, vocab, params, registry, tuning=table, steps=steps)
    runs = {"untuned": Run("priority order", [], []), "tuned": Run(f"table {table}", [], [])}
    states = {"untuned": (untuned, untuned.params, untuned.opt_state),
              "tuned": (tuned, tuned.params, tuned.opt_state)}
    for batch in batches(data, cfg, steps):
        for name, (t, p, o) in states.items():
            start = time.perf_counter()
            p, o, loss = t.step(p, o, jnp.asarray(batch))
            runs[name].losses.append(float(loss))  # float() waits for the step
            runs[name].step_seconds.append(time.perf_counter() - start)
            states[name] = (t, p, o)
    for run in runs.values():
        run.step_seconds = run.step_seconds[1:]  # the first step compiles
    return runs["untuned"], runs["tuned"]


def step_memory(
    backend: str, cfg: Config = Config(), registry: attn_backends.Registry | None = None
) -> dict[str, int]:
    """Bytes of one compiled training step, from its ``memory_analysis()``.

    ``peak`` = arguments + outputs + temporaries - aliased (the donated or
    reused buffers counted once).
    """
    data, vocab = load_corpus()
    registry = registry if registry is not None else attn_backends.registry
    t = trainer(backend, cfg, vocab, init_state(cfg, vocab), registry)
    batch = jnp.asarray(batches(data, cfg, 1)[0])
    m = t.step.lower(t.params, t.opt_state, batch).compile().memory_analysis()
    parts = {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
    }
    parts["peak"] = parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="xla_native",
                        help="a registry backend name, or 'flax' for flax's own attention")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tune", default=None, metavar="TABLE",
                        help="train the registry's choice untuned and with this tuning "
                        "table (made first if missing), steps in turn, and compare")
    parser.add_argument("--serving", action="store_true",
                        help=f"train the model examples/serving serves ({SERVING_STEPS} steps) "
                        "into --checkpoint, unless it holds that model's weights already")
    parser.add_argument("--checkpoint", default=SERVING_CHECKPOINT,
                        help="where --serving keeps the weights (default: %(default)s)")
    args = parser.parse_args()
    if args.serving:
        weights = trained_params(SERVING, SERVING_STEPS, args.checkpoint, args.backend,
                                 log_every=SERVING_STEPS // 10)
        done = "saved" if weights.trained_because else "up to date, nothing to train:"
        print(f"{done} {os.path.relpath(args.checkpoint)} ({SERVING_STEPS} steps, "
              f"loss {weights.loss:.4f})")
        return
    if args.tune:
        untuned, tuned = compare_tuned(args.tune, args.steps)
        for run in (untuned, tuned):
            print(f"{run.backend:<40} median step "
                  f"{1e3 * float(np.median(run.step_seconds)):.2f} ms, "
                  f"final loss {run.losses[-1]:.4f}")
        ratio = float(np.median(untuned.step_seconds) / np.median(tuned.step_seconds))
        print(f"tuned step is {ratio:.2f}x the speed of the untuned one (same process)")
        return
    run = train(args.backend, args.steps, log_every=max(1, args.steps // 10))
    print(f"final loss {run.losses[-1]:.4f}  ({args.backend}, "
          f"median step {1e3 * float(np.median(run.step_seconds or [0.0])):.1f} ms on cpu)")


if __name__ == "__main__":
    main()
