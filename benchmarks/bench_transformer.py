"""examples/transformer trained once per backend on cpu: loss curves, step time, memory.

    .venv/bin/python benchmarks/bench_transformer.py [--steps 300] [--plot loss.png]

Each backend trains the example's model from the same initialisation on the
same batches; ``flax`` is flax's own attention, the baseline the others are
compared with. Prints a markdown table: the first step whose loss differs
from the baseline's by more than 1e-3 (float32 rounding differences grow as
training goes on), the largest difference between 50-step mean losses, the
mean loss of the last 50 steps, the median step time and its ratio to the
baseline's (measured in the same run, one after the other), and the compiled
step's peak memory (``memory_analysis()``). ``--plot`` writes
the loss curves as a PNG (needs matplotlib). flash_pallas runs its Pallas
kernels in interpret mode (an emulator: its time says nothing of a TPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys

os.environ.setdefault("ATTN_BACKENDS_PALLAS_INTERPRET", "1")

import attn_backends  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "transformer", "train.py")
_spec = importlib.util.spec_from_file_location("transformer_example", _PATH)
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example
_spec.loader.exec_module(example)

CANDIDATES = ("flax", "reference", "xla_native", "example_dense", "flash_pallas")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--backends", default=",".join(CANDIDATES))
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    parser.add_argument("--json", default=None, help="write losses and figures to this file")
    args = parser.parse_args()
    installed = set(attn_backends.registry.backends) | {"flax"}
    names = [b for b in args.backends.split(",") if b in installed]
    cfg = example.Config()
    runs, memory = {}, {}
    for name in names:
        runs[name] = example.train(name, args.steps, cfg)
        memory[name] = example.step_memory(name, cfg)
        print(f"{name}: final loss {runs[name].losses[-1]:.4f}", file=sys.stderr)
    base = runs[names[0]]
    base_ms = 1e3 * float(np.median(base.step_seconds))
    print(f"\n{args.steps} steps, {cfg}; jax {jax.__version__}, {platform.processor() or 'cpu'}")
    print(f"\n| backend | first step off by > 1e-3 | max diff of 50-step means | "
          f"last 50 steps' mean loss | median step ms | ratio to {names[0]} | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    windows = args.steps // 50
    for name in names:
        losses = np.array(runs[name].losses)
        off = np.abs(losses - np.array(base.losses)) > 1e-3
        first = str(int(np.argmax(off))) if off.any() else "none"
        mean_diff = "-"
        if windows:
            means = losses[: 50 * windows].reshape(windows, 50).mean(1)
            base_means = np.array(base.losses[: 50 * windows]).reshape(windows, 50).mean(1)
            mean_diff = f"{float(np.max(np.abs(means - base_means))):.3f}"
        ms = 1e3 * float(np.median(runs[name].step_seconds))
        print(f"| {name} | {first} | {mean_diff} | {losses[-50:].mean():.4f} | {ms:.1f} | "
              f"{ms / base_ms:.2f} | {memory[name]['peak'] / 2**20:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {"losses": r.losses, "step_seconds": r.step_seconds,
                           "memory": memory[n]} for n, r in runs.items()}, f)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, run in runs.items():
            ax.plot(np.arange(1, len(run.losses) + 1), run.losses, label=name, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (cross-entropy, nats/char)")
        ax.set_title(f"examples/transformer on cpu: {cfg.layers} layers, d_model {cfg.d_model}, "
                     f"seq {cfg.seq}, batch {cfg.batch}", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
