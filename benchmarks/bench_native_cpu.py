"""Speed of the native_cpu backend (C++ through XLA's FFI) against its peers on this machine.

Run from the repo root, in an environment with torch (benchmarks/requirements.txt;
the PyTorch CPU wheels need Python 3.11 here, so .venv-jax-0.10):

    .venv-jax-0.10/bin/python benchmarks/bench_native_cpu.py
    .venv-jax-0.10/bin/python benchmarks/bench_native_cpu.py --sizes 1024,4096 --no-decode

Dense: B=1, H=8, D=64, causal, float32 (--dtype bfloat16 too); forward and forward+backward of
native_cpu, xla_native and PyTorch's scaled_dot_product_attention, timed in
the same process in alternating blocks (bench_xla_native.in_rounds), best
times. Decode: bench_decode.py's case (B=8, Hq=32, Hkv=8, D=128, Tq=1,
kv_lengths in [Tk/2, Tk]) for native_cpu beside xla_native, torch and the
jnp.sum bandwidth probe, medians; each contender's share of the bandwidth is
counted on the bytes a step needs (the keys below each kv_length, 76% of
the cache in this case) over the probe's on the whole cache. Paged decode:
bench_paged.py's full shape, native_cpu's and xla_native's paged calls,
checked against each other, beside jnp.sum over the pool (bandwidth on the
live tokens' bytes, as bench_paged.py counts it).
On jaxlib < 0.12 xla_native's decode path is off and its decode column times
its blockwise kernel (see bench_decode.py).

The machine's cores may be shared with other work: read the ratios of one run,
never the absolute times of two.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from attn_backend_native_cpu._library import kernel_isa
from attn_backend_native_cpu._plugin import NativeCpuBackend
from bench_decode import _case_arrays, sum_run, torch_run, xla_native_run
from bench_decode import in_rounds as decode_rounds
from bench_paged import Shape, make_pool
from bench_xla_native import in_rounds, jax_runner, torch_runner, xla_native
from plotting import progress

_BACKEND = NativeCpuBackend()


def native(q: Any, k: Any, v: Any, causal: bool, blocks: Any) -> Any:
    call, ops = attn_backends.bind(q, k, v, causal=causal)
    return _BACKEND.attend(call, q, k, v, ops)


def dense_table(args: argparse.Namespace) -> None:
    print(f"\nB=1, H=8, D=64, causal, {args.dtype}; ms: best (median) of rounds x reps")
    print("\n| S | pass | timed runs | native_cpu ms | xla_native ms | torch sdpa ms "
          "| native / torch | native / xla_native |")
    print("|---|---|---|---|---|---|---|---|")
    for s in progress(args.sizes, desc="dense"):
        for backward in (False, True):
            if backward and s > args.bwd_max:
                continue
            reps, rounds = (args.reps, args.rounds) if s <= args.long_from else (1, 1)
            runs = {"native": jax_runner(native, s, True, backward, dtype=args.dtype),
                    "xla": jax_runner(xla_native, s, True, backward, dtype=args.dtype)}
            torch_run_ = torch_runner(s, True, backward, args.dtype)
            if torch_run_ is not None:
                runs["torch"] = torch_run_
            times = in_rounds(runs, reps, rounds)
            best = {n: min(t) for n, t in times.items()}
            cell = {n: f"{best[n] * 1e3:.1f} ({statistics.median(t) * 1e3:.1f})"
                    for n, t in times.items()}
            vs_torch = f"{best['native'] / best['torch']:.2f}x" if "torch" in best else "-"
            print(f"| {s} | {'fwd+bwd' if backward else 'fwd'} | {rounds}x{reps} "
                  f"| {cell['native']} | {cell['xla']} | {cell.get('torch', '-')} "
                  f"| {vs_torch} | {best['native'] / best['xla']:.2f}x |", flush=True)


def native_decode_run(q: Any, k: Any, v: Any, lengths: Any) -> Any:
    def f(q: Any, k: Any, v: Any, lengths: Any) -> Any:
        call, ops = attn_backends.bind(q, k, v, causal=True, kv_lengths=lengths)
        return _BACKEND.attend(call, q, k, v, ops)

    g = jax.jit(f)
    return lambda: jax.block_until_ready(g(q, k, v, lengths))


def _share(med: dict[str, float], name: str, live: float) -> str:
    """``ms (share of the sum's bandwidth)`` of one contender, or - when absent.

    ``live``: the fraction of the cache's bytes a step needs (the keys below
    each row's kv_length): a contender reading only those moves live x the
    probe's bytes, so its bandwidth is live x (probe bytes) / t."""
    if name not in med:
        return "-"
    return f"{med[name] * 1e3:.2f} ({live * med['sum'] / med[name] * 100:.0f}%)"


def decode_table(args: argparse.Namespace) -> None:
    print("\nDecode: B=8, Hq=32, Hkv=8, D=128, Tq=1, causal, kv_lengths in [Tk/2, Tk]; "
          "medians; % = bandwidth on the live keys' K and V (below each kv_length) over "
          "the jnp.sum's on the whole cache")
    print("\n| dtype | Tk | jnp.sum ms (GB/s) | native_cpu ms (%) | xla_native ms (%) "
          "| torch ms (%) | native / torch |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.decode_dtypes:
        q, k, v, lengths = _case_arrays(8, 1, args.tk, 32, 8, 128, dtype)
        runs = {"sum": sum_run(k, v), "native": native_decode_run(q, k, v, lengths),
                "xla": xla_native_run(q, k, v, lengths)}
        torch_ = torch_run(q, k, v, lengths)
        if torch_ is not None:
            runs["torch"] = torch_
        med = {n: statistics.median(t)
               for n, t in decode_rounds(runs, args.reps, args.rounds).items()}
        gbs = 2 * k.size * k.dtype.itemsize / med["sum"] / 1e9
        live = float(np.asarray(lengths).sum()) / (k.shape[0] * k.shape[1])

        vs_torch = f"{med['native'] / med['torch']:.2f}x" if "torch" in med else "-"
        print(f"| {dtype} | {args.tk} | {med['sum'] * 1e3:.2f} ({gbs:.1f}) "
              f"| {_share(med, 'native', live)} | {_share(med, 'xla', live)} "
              f"| {_share(med, 'torch', live)} "
              f"| {vs_torch} |", flush=True)


def paged_table(args: argparse.Namespace) -> None:
    print("\nPaged decode step: bench_paged.py's full shape (32 sequences of 1024-4096 "
          "tokens, page size 16, GQA 32:8, D=128, float32, pages in random order); "
          "medians; % = bandwidth on the live tokens' K and V over the jnp.sum's on the pool")
    print("\n| jnp.sum ms (GB/s) | native_cpu ms (%) | xla_native ms (%) | native / xla_native |")
    print("|---|---|---|---|")
    shape = Shape.full()
    pool = make_pool(shape)
    q = jax.random.normal(jax.random.key(1), (shape.seqs, shape.hq, shape.d))
    batch = attn_backends.PagedBatch(jnp.arange(shape.seqs + 1, dtype=jnp.int32),
                                     jnp.asarray(pool.lengths), jnp.asarray(pool.table),
                                     jnp.int32(shape.seqs))
    runs, outs = {}, {}
    for name in ("native_cpu", "xla_native"):
        paged = attn_backends.registry.get_paged(
            backend=name, num_q_heads=shape.hq, num_kv_heads=shape.hkv, head_dim=shape.d,
            page_size=shape.page_size, dtype="float32")
        cache = paged.from_canonical(jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages))
        fn = jax.jit(paged.__call__)
        outs[name] = np.asarray(fn(q, cache, batch))
        runs[name] = functools.partial(lambda f, c: jax.block_until_ready(f(q, c, batch)), fn,
                                       cache)
    diff = float(np.abs(outs["native_cpu"] - outs["xla_native"]).max())
    assert diff < 1e-4, f"native_cpu and xla_native paged outputs differ by {diff}"
    runs = {"sum": sum_run(jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages)), **runs}
    med = {n: statistics.median(t)
           for n, t in decode_rounds(runs, args.reps, args.rounds).items()}
    pool_bytes = pool.k_pages.nbytes + pool.v_pages.nbytes
    gbs = pool_bytes / med["sum"] / 1e9

    def share(name: str) -> str:
        return f"{med[name] * 1e3:.2f} ({pool.live_bytes / med[name] / 1e9 / gbs * 100:.0f}%)"

    print(f"| {med['sum'] * 1e3:.2f} ({gbs:.1f}) | {share('native_cpu')} | {share('xla_native')} "
          f"| {med['native_cpu'] / med['xla_native']:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--sizes", type=ints, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--bwd-max", type=int, default=16384)
    parser.add_argument("--long-from", type=int, default=4096,
                        help="sizes above this run one round of one timed run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the dense table's dtype")
    parser.add_argument("--tk", type=int, default=4096)
    parser.add_argument("--decode-dtypes", type=lambda s: s.split(","),
                        default=["float32", "bfloat16"])
    parser.add_argument("--no-dense", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--no-paged", action="store_true")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()}; jax {jax.__version__}; "
          f"native_cpu kernels {kernel_isa()}")
    if not args.no_dense:
        dense_table(args)
    if not args.no_decode:
        decode_table(args)
    if not args.no_paged:
        paged_table(args)


if __name__ == "__main__":
    main()
