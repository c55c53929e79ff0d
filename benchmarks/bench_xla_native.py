"""Speed and memory of the xla_native backend against its peers on this machine.

Run from the repo root:

    .venv/bin/python benchmarks/bench_xla_native.py            # everything
    .venv/bin/python benchmarks/bench_xla_native.py --sizes 1024,4096 --no-memory
    .venv/bin/python benchmarks/bench_xla_native.py --no-speed  # memory only (compiles, never runs)

Speed: B=1, H=8, D=64, float32; forward and forward+backward of xla_native,
jax.nn.dot_product_attention(implementation="xla") and PyTorch's
scaled_dot_product_attention on CPU (if torch is installed; see
benchmarks/requirements.txt), all in one process. Each contender runs in
blocks: one untimed run, then --reps timed runs back to back; the blocks of
all contenders alternate for --rounds rounds, so load drift on a shared
machine hits them alike, and the best time is kept. Blocks rather than
run-by-run alternation, because a run pays for what the previous program
left behind: right after the dense path (which maps and frees gigabytes of
S x S scores) the next program page-faults on its fresh buffers, and right
after PyTorch its OpenMP workers still spin on the same cores. Also reported
as a fraction of this machine's float32 matmul rate (a 2048 x 2048
jnp.matmul timed in the same run).

Memory: temp_size_in_bytes of the compiled forward and forward+backward
programs (compile only), xla_native next to the dense XLA path.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
from attn_backend_xla_native import BlockConfig, XlaNativeBackend
from plotting import progress

B, H, D = 1, 8, 64
_BACKEND = XlaNativeBackend()


def xla_native(q: Any, k: Any, v: Any, causal: bool, blocks: BlockConfig | None) -> Any:
    call, ops = attn_backends.bind(q, k, v, causal=causal)
    return _BACKEND.attend(call, q, k, v, ops, blocks)


def dense(q: Any, k: Any, v: Any, causal: bool, blocks: BlockConfig | None) -> Any:
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def _fwd_bwd(attn: Callable, causal: bool, blocks: BlockConfig | None) -> Callable:
    def f(q: Any, k: Any, v: Any, do: Any) -> Any:
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, causal, blocks), q, k, v)
        return vjp(do)

    return f


def _fwd(attn: Callable, causal: bool, blocks: BlockConfig | None) -> Callable:
    return lambda q, k, v, do: attn(q, k, v, causal, blocks)


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def in_rounds(runs: dict[str, Callable[[], Any]], reps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per timed run of each contender: ``rounds`` rounds, in each of
    which every contender makes one untimed run (the first also compiles)
    and then ``reps`` timed runs back to back."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()
            times[name] += [_timed(run) for _ in range(reps)]
    return times


def _inputs(s: int, dtype: str = "float32") -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, (B, s, H, D), dtype) for key in keys)


def jax_runner(
    attn: Callable, s: int, causal: bool, backward: bool, blocks: BlockConfig | None = None,
    dtype: str = "float32",
) -> Callable[[], Any]:
    make = _fwd_bwd if backward else _fwd
    f = jax.jit(make(attn, causal, blocks))
    args = _inputs(s, dtype)
    return lambda: jax.block_until_ready(f(*args))


def torch_runner(
    s: int, causal: bool, backward: bool, dtype: str = "float32"
) -> Callable[[], Any] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, s, D, dtype=getattr(torch, dtype)) for _ in range(4))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:

        def run() -> None:
            with torch.no_grad():
                sdpa(q, k, v, is_causal=causal)

        return run
    for t in (q, k, v):
        t.requires_grad_(True)

    def run_bwd() -> None:
        out = sdpa(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), do)

    return run_bwd


def matmul_gflops(reps: int) -> float:
    a = jax.random.normal(jax.random.key(1), (2048, 2048), jnp.float32)
    f = jax.jit(jnp.matmul)
    seconds = min(in_rounds({"matmul": lambda: f(a, a).block_until_ready()}, reps, 1)["matmul"])
    return 2 * 2048**3 / seconds / 1e9


def attention_gflop(s: int, causal: bool, backward: bool) -> float:
    """Useful work: 2 matmuls forward, 5 (recompute included) forward+backward."""
    matmuls = 7 if backward else 2
    return matmuls * 2 * B * H * s * s * D * (0.5 if causal else 1.0) / 1e9


def temp_bytes(
    attn: Callable, s: int, backward: bool, causal: bool = True, blocks: BlockConfig | None = None
) -> int:
    make = _fwd_bwd if backward else _fwd
    spec = jax.ShapeDtypeStruct((B, s, H, D), jnp.float32)
    compiled = jax.jit(make(attn, causal, blocks)).lower(spec, spec, spec, spec).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _machine() -> str:
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def _ratio(other: float | None, ours: float) -> str:
    return "-" if other is None else f"{other / ours:.2f}x"


def speed(args: argparse.Namespace) -> None:
    rate = matmul_gflops(30)
    print(f"\nfloat32 matmul 2048x2048: {rate:.1f} GFLOP/s (best of 30)")
    print(
        "\nms: best (median) of the timed runs (rounds x reps); ratios and the "
        "matmul-rate share use the best times."
    )
    print(
        "\n| S | causal | pass | timed runs | xla_native ms | dense xla ms | torch sdpa ms "
        "| dense / xla_native | torch / xla_native | xla_native % of matmul rate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = [(s, True) for s in args.sizes]
    if args.noncausal:
        cases.append((args.noncausal, False))
    for s, causal in progress(cases, desc="bench_xla_native"):
        for backward in (False, True):
            if backward and s > args.bwd_max:
                continue
            reps = args.reps if s <= args.long_from else args.long_reps
            runs = {"ours": jax_runner(xla_native, s, causal, backward, args.blocks)}
            if s <= args.dense_max:
                runs["dense"] = jax_runner(dense, s, causal, backward)
            torch_run = None if args.no_torch else torch_runner(s, causal, backward)
            if torch_run is not None:
                runs["torch"] = torch_run
            times = in_rounds(runs, reps, args.rounds)
            best = {name: min(t) for name, t in times.items()}
            cell = {
                name: f"{best[name] * 1e3:.1f} ({statistics.median(t) * 1e3:.1f})"
                for name, t in times.items()
            }
            ours = best["ours"]
            pct = attention_gflop(s, causal, backward) / ours / rate * 100
            print(
                f"| {s} | {causal} | {'fwd+bwd' if backward else 'fwd'} | {args.rounds}x{reps} "
                f"| {cell['ours']} | {cell.get('dense', '-')} | {cell.get('torch', '-')} "
                f"| {_ratio(best.get('dense'), ours)} | {_ratio(best.get('torch'), ours)} "
                f"| {pct:.0f}% |",
                flush=True,
            )


def memory(args: argparse.Namespace) -> None:
    print("\nCompiled temp memory (MiB), causal, B=1 H=8 D=64 float32 (compile only)")
    print("\n| S | xla_native fwd | dense fwd | xla_native fwd+bwd | dense fwd+bwd |")
    print("|---|---|---|---|---|")
    for s in args.memory_sizes:
        cells = [
            temp_bytes(attn, s, backward) / 2**20
            for backward in (False, True)
            for attn in (xla_native, dense)
        ]
        print(f"| {s} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


def page_faults(args: argparse.Namespace) -> None:
    """Minor page faults per call (getrusage), after warm-up runs: the cost of
    a program whose temporaries glibc maps fresh on every call."""
    print("\nMinor page faults per call after 3 warm-up calls (mean of 5), causal fwd")
    print("\n| S | xla_native temp MiB | xla_native faults/call |")
    print("|---|---|---|")
    for s in args.sizes:
        if s > args.long_from:
            continue
        run = jax_runner(xla_native, s, True, False, args.blocks)
        for _ in range(3):
            run()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            run()
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
        temp = temp_bytes(xla_native, s, False, blocks=args.blocks) / 2**20
        print(f"| {s} | {temp:.1f} | {faults:.0f} |", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=_ints,
        default=[1024, 4096, 16384],
        help="causal sequence lengths to time (default 1024,4096,16384)",
    )
    parser.add_argument(
        "--noncausal",
        type=int,
        default=4096,
        help="also time this length without causal mask (0: skip)",
    )
    parser.add_argument("--reps", type=int, default=3, help="timed runs per contender per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of blocks per case")
    parser.add_argument(
        "--long-from", type=int, default=8192, help="lengths above this use --long-reps"
    )
    parser.add_argument("--long-reps", type=int, default=1)
    parser.add_argument(
        "--bwd-max", type=int, default=16384, help="skip forward+backward above this length"
    )
    parser.add_argument(
        "--dense-max",
        type=int,
        default=4096,
        help="skip the dense XLA path above this length (its S x S scores need 16 GiB "
        "forward and 24 GiB forward+backward at S=16384)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    parser.add_argument("--block-q", type=int, default=None)
    parser.add_argument("--block-kv", type=int, default=None)
    parser.add_argument("--memory-sizes", type=_ints, default=[4096, 16384, 65536])
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    args.blocks = None
    if args.block_q or args.block_kv:
        args.blocks = BlockConfig(args.block_q or 512, args.block_kv or 512)
    print(f"machine: {_machine()}; load average: {os.getloadavg()}")
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, blocks "
        f"{args.blocks or 'default_for(call, platform)'}"
    )
    if not args.no_speed:
        speed(args)
    if not args.no_memory:
        memory(args)
        page_faults(args)
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
