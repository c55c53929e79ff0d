"""tokamax's plain-XLA attention (its ``xla`` and ``xla_chunked``) against xla_native and
PyTorch's SDPA on this machine's CPU, in one process, through the registry's backends.

Run from the repo root (PyTorch from benchmarks/requirements.txt; torch 2.13.0's
CPU wheel is for Python 3.11, so the compatibility environment runs it):

    .venv-jax-0.10/bin/python benchmarks/bench_tokamax.py                 # everything
    .venv-jax-0.10/bin/python benchmarks/bench_tokamax.py --sizes 1024,2048 --no-memory

Speed: B=1, H=8, D=64, float32, causal; forward and forward+backward of each
contender, timed in alternating blocks (bench_xla_native.in_rounds: one untimed
run, then --reps timed runs, for --rounds rounds; the best time kept). The
ratios are each contender's best time over xla_native's in the same run.

Memory: temp_size_in_bytes of each compiled program (compile only, never
run) at --memory-sizes, causal forward and forward+backward.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import attn_backends
import jax
from attn_backend_tokamax import TokamaxXlaBackend, TokamaxXlaChunkedBackend
from bench_xla_native import (
    _machine,
    in_rounds,
    jax_runner,
    temp_bytes,
    torch_runner,
    xla_native,
)
from plotting import progress


def _through(backend: attn_backends.Backend) -> Callable[..., Any]:
    def attend(q: Any, k: Any, v: Any, causal: bool, blocks: Any) -> Any:
        call, ops = attn_backends.bind(q, k, v, causal=causal)
        return backend.attend(call, q, k, v, ops)

    return attend


CONTENDERS: dict[str, Callable[..., Any]] = {
    "xla_native": xla_native,
    "tokamax_xla": _through(TokamaxXlaBackend()),
    "tokamax_xla_chunked": _through(TokamaxXlaChunkedBackend()),
}


def speed(args: argparse.Namespace) -> None:
    names = [*CONTENDERS, "torch_sdpa"]
    print("\nms: best of the timed runs (rounds x reps); ratio: best time / xla_native's")
    print("\n| S | pass | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"{n} / xla_native" for n in names[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(names) - 1))
    for s in progress(args.sizes, desc="bench_tokamax"):
        for backward in (False, True):
            runs = {name: jax_runner(attn, s, True, backward) for name, attn in CONTENDERS.items()
                    if not (name == "tokamax_xla" and s > args.dense_max)}
            torch_run = torch_runner(s, True, backward)
            if torch_run is not None:
                runs["torch_sdpa"] = torch_run
            best = {name: min(t) for name, t in in_rounds(runs, args.reps, args.rounds).items()}
            ours = best["xla_native"]
            cells = [f"{best[n] * 1e3:.1f}" if n in best else "-" for n in names]
            ratios = [f"{best[n] / ours:.2f}x" if n in best else "-" for n in names[1:]]
            print(f"| {s} | {'fwd+bwd' if backward else 'fwd'} | " + " | ".join(cells) + " | "
                  + " | ".join(ratios) + " |", flush=True)


def memory(args: argparse.Namespace) -> None:
    print("\nCompiled temp memory (MiB), causal, B=1 H=8 D=64 float32 (compile only)")
    print("\n| S | pass | " + " | ".join(CONTENDERS) + " |")
    print("|---|---|" + "---|" * len(CONTENDERS))
    for s in args.memory_sizes:
        for backward in (False, True):
            cells = [temp_bytes(attn, s, backward) / 2**20 for attn in CONTENDERS.values()]
            print(f"| {s} | {'fwd+bwd' if backward else 'fwd'} | "
                  + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_ints, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=2, help="timed runs per contender per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of blocks per case")
    parser.add_argument("--dense-max", type=int, default=8192,
                        help="skip tokamax_xla (S x S logits) above this length")
    parser.add_argument("--memory-sizes", type=_ints, default=[65536])
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    print(f"machine: {_machine()}; load average: {os.getloadavg()}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    if not args.no_speed:
        speed(args)
    if not args.no_memory:
        memory(args)
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
