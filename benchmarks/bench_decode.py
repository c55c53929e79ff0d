"""Decode steps (a few new queries against a long KV cache) on this machine.

Run from the repo root:

    .venv/bin/python benchmarks/bench_decode.py                     # the full table
    .venv/bin/python benchmarks/bench_decode.py --tk 4096 --rounds 3  # a short run

xla_native's decode path serves only on jaxlib >= 0.12, the default
``.venv``'s line; on older jaxlib (``.venv-jax-0.10``, the compatibility
environment) the "xla_native" column times its blockwise kernel.

Each case: B=8, Hq=32, Hkv=8, D=128, Tq=1, causal (aligned bottom-right:
the new query sees the whole cache), ``kv_lengths`` drawn in [Tk/2, Tk];
Tk = 4096 and 32768, float32 and bfloat16; plus Tq=4 (speculative
decoding) and MQA (Hkv=1) rows. Contenders, all timed in the same run:
xla_native (the backend's ``attend``), the dense XLA path
``jax.nn.dot_product_attention(implementation="xla")`` and PyTorch's
``scaled_dot_product_attention`` on CPU (if torch is installed; see
benchmarks/requirements.txt), plus a jitted ``jnp.sum`` over the same K and
V: the bandwidth a one-pass reader gets here. Each contender's share of
that bandwidth is ``t_sum / t``: bytes of K and V (the whole cache, as
allocated) per second, against the sum's.

Timing: rounds of blocks; in each round every contender makes one untimed
run then ``--reps`` timed runs, contenders in turn, so load drift on a
shared machine hits all alike. Medians of the timed runs are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from attn_backend_xla_native import XlaNativeBackend
from plotting import progress

_BACKEND = XlaNativeBackend()


def _case_arrays(b: int, tq: int, tk: int, hq: int, hkv: int, d: int, dtype: str) -> tuple:
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
        for shape in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d))
    )
    lengths = jnp.asarray(rng.integers(tk // 2, tk + 1, b), jnp.int32)
    return q, k, v, lengths


def _visible(tq: int, tk: int, lengths: Any) -> Any:
    """``[B, 1, Tq, Tk]`` bool: causal aligned bottom-right, and kv_lengths."""
    key = jnp.arange(tk)[None, None, None, :]
    row = jnp.arange(tq)[None, None, :, None]
    return (key <= row + tk - tq) & (key < lengths[:, None, None, None])


def xla_native_run(q: Any, k: Any, v: Any, lengths: Any) -> Callable[[], Any]:
    def f(q: Any, k: Any, v: Any, lengths: Any) -> Any:
        call, ops = attn_backends.bind(q, k, v, causal=True, kv_lengths=lengths)
        return _BACKEND.attend(call, q, k, v, ops)

    g = jax.jit(f)
    return lambda: jax.block_until_ready(g(q, k, v, lengths))


def blockwise_run(q: Any, k: Any, v: Any, lengths: Any) -> Callable[[], Any]:
    """xla_native's blockwise kernel, which served these calls before the
    decode path (for ``--tq-sweep``: where the plan should switch)."""
    from attn_backend_xla_native import BlockConfig
    from attn_backend_xla_native._kernel import _attention
    from attn_backend_xla_native._plan import Plan, prepare_masks

    def f(q: Any, k: Any, v: Any, lengths: Any) -> Any:
        call, ops = attn_backends.bind(q, k, v, causal=True, kv_lengths=lengths)
        blocks = BlockConfig.default_for(call, "cpu")
        plan, bwd_plan = Plan.of(call, blocks), Plan.of(call, blocks.backward())
        masks, bwd_masks = prepare_masks(plan, ops), prepare_masks(bwd_plan, ops)
        return _attention(plan, bwd_plan, q, k, v, None, masks, bwd_masks)[0]

    g = jax.jit(f)
    return lambda: jax.block_until_ready(g(q, k, v, lengths))


def tq_sweep(args: argparse.Namespace) -> None:
    print("\nDecode path against the blockwise kernel by Tq (B=8, Hq=32, Hkv=8, D=128, "
          "causal, kv_lengths in [Tk/2, Tk]), medians")
    print("\n| dtype | Tk | Tq | decode ms | blockwise ms | blockwise / decode |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for tq in (1, 4, 8, 16):
            q, k, v, lengths = _case_arrays(8, tq, args.tk[0], 32, 8, 128, dtype)
            runs = {
                "ours": xla_native_run(q, k, v, lengths),
                "blockwise": blockwise_run(q, k, v, lengths),
            }
            times = in_rounds(runs, args.reps, args.rounds)
            med = {n: statistics.median(t) for n, t in times.items()}
            print(
                f"| {dtype} | {args.tk[0]} | {tq} | {med['ours'] * 1e3:.1f} "
                f"| {med['blockwise'] * 1e3:.1f} | {med['blockwise'] / med['ours']:.2f}x |",
                flush=True,
            )


def dense_run(q: Any, k: Any, v: Any, lengths: Any) -> Callable[[], Any]:
    tq, tk = q.shape[1], k.shape[1]

    def f(q: Any, k: Any, v: Any, lengths: Any) -> Any:
        # jax.nn's is_causal aligns top-left; the cache needs bottom-right.
        mask = _visible(tq, tk, lengths)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    g = jax.jit(f)
    return lambda: jax.block_until_ready(g(q, k, v, lengths))


def torch_run(q: Any, k: Any, v: Any, lengths: Any) -> Callable[[], Any] | None:
    try:
        import torch
    except ImportError:
        return None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(q.dtype)]

    def to_torch(x: Any) -> Any:  # BTNH -> BNTH, its native layout
        return torch.from_numpy(np.asarray(x, np.float32)).to(dtype).transpose(1, 2).contiguous()

    tq_, tk_, tv_ = (to_torch(x) for x in (q, k, v))
    mask = torch.from_numpy(np.asarray(_visible(q.shape[1], k.shape[1], lengths)))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[2] != k.shape[2]

    def run() -> None:
        with torch.no_grad():
            sdpa(tq_, tk_, tv_, attn_mask=mask, enable_gqa=gqa)

    return run


def sum_run(k: Any, v: Any) -> Callable[[], Any]:
    g = jax.jit(lambda k, v: jnp.sum(k) + jnp.sum(v))
    return lambda: jax.block_until_ready(g(k, v))


def in_rounds(runs: dict[str, Callable[[], Any]], reps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per timed run of each contender (see the module docstring)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()
            for _ in range(reps):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return times


def cases(args: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    """(dtype, Tk, Tq, Hq, Hkv) of every row."""
    rows = []
    for dtype in args.dtypes:
        for tk in args.tk:
            rows.append((dtype, tk, 1, 32, 8))
            if not args.no_extra:
                rows += [(dtype, tk, 4, 32, 8), (dtype, tk, 1, 32, 1)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tk", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 32768]
    )
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-extra", action="store_true", help="skip the Tq=4 and MQA rows")
    parser.add_argument("--tq-sweep", action="store_true",
                        help="only time the decode path against the blockwise kernel at "
                        "Tq = 1, 4, 8, 16 (first --tk)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()}; jax {jax.__version__}")
    if args.tq_sweep:
        tq_sweep(args)
        return
    print("\nB=8, Hq=32, D=128, causal, kv_lengths in [Tk/2, Tk]; medians of rounds x reps; "
          "% = share of the jnp.sum bandwidth (t_sum / t)")
    print("\n| dtype | Tk | Tq | Hkv | timed runs | jnp.sum ms (GB/s) | xla_native ms (%) "
          "| dense ms (%) | torch ms (%) | xla_native vs faster peer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype, tk, tq, hq, hkv in progress(list(cases(args)), desc="bench_decode"):
        q, k, v, lengths = _case_arrays(8, tq, tk, hq, hkv, 128, dtype)
        runs = {
            "sum": sum_run(k, v),
            "ours": xla_native_run(q, k, v, lengths),
            "dense": dense_run(q, k, v, lengths),
        }
        torch_fn = None if args.no_torch else torch_run(q, k, v, lengths)
        if torch_fn is not None:
            runs["torch"] = torch_fn
        med = {n: statistics.median(t) for n, t in in_rounds(runs, args.reps, args.rounds).items()}
        gbps = (k.nbytes + v.nbytes) / med["sum"] / 1e9

        def cell(name: str, med: dict[str, float] = med) -> str:
            if name not in med:
                return "-"
            return f"{med[name] * 1e3:.1f} ({100 * med['sum'] / med[name]:.0f}%)"

        peer = min(med[n] for n in ("dense", "torch") if n in med)
        print(
            f"| {dtype} | {tk} | {tq} | {hkv} | {args.rounds}x{args.reps} "
            f"| {med['sum'] * 1e3:.1f} ({gbps:.1f}) | {cell('ours')} | {cell('dense')} "
            f"| {cell('torch')} | {peer / med['ours']:.2f}x |",
            flush=True,
        )
        del runs, q, k, v
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
