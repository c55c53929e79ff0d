"""Paged attention (issue 24) on this machine: xla_native's paged kernel against
its contiguous decode path, a mixed batch, and the paged step's temporary memory.

Run from the repo root (the decode path serves only on jaxlib >= 0.12, the
default ``.venv``'s line; on older jaxlib the "contiguous" contender is
xla_native's blockwise kernel, and the output says so):

    .venv/bin/python benchmarks/bench_paged.py              # the full run
    .venv/bin/python benchmarks/bench_paged.py --quick      # small shapes, seconds
    .venv/bin/python benchmarks/bench_paged.py --json       # one JSON object on stdout

Shapes (full run): 32 sequences, lengths drawn in [1024, 4096] (seed 0), page
size 16, GQA 32:8, D=128, float32, pages handed out in a random order.

1. Decode step (one new row per sequence, its key already in the cache):
   ``paged(q [32, 32, 128], cache, batch)`` against the contiguous decode path
   on the same lengths (``attend`` with q ``[32, 1, 32, 128]``, a ``[32,
   max_len, 8, 128]`` cache, ``causal=True`` and ``kv_lengths``), both jitted,
   plus a jitted ``jnp.sum`` over the pool's K and V: the bandwidth a one-pass
   reader gets here in the same run. Each contender's fraction of bandwidth is
   the bytes the step must read (K and V of the live tokens) per second over
   the sum's bytes per second. A third contender, ``einsum_ceiling``, is the
   least a decode step computes as XLA compiles it: two einsums and a softmax
   over the whole contiguous cache, no lengths, no mask (not attention: its
   output is not checked); its fraction, of the whole cache's bytes, is about
   what a plain-XLA decode step can reach on this machine in the contract's
   ``[S, L, Hkv, D]`` layout. ``einsum_ceiling_heads_first`` is the same over
   the cache transposed to ``[S, Hkv, L, D]`` beforehand (the transpose not
   timed): what a layout with each head's keys contiguous would allow.
2. Mixed batch: one 512-token prefill chunk (the last 512 positions of
   sequence 0) plus 31 decode steps, paged in one call, against the prefill
   (q ``[1, 512, 32, 128]`` against sequence 0's own contiguous cache,
   causal) and the decodes (the contiguous decode path on 31 sequences) as two
   dense calls, each jitted, run back to back.
3. Temporary memory of the paged decode step (``compiled.memory_analysis()``,
   compile only) at several pool sizes.

Timing: rounds; in each round every contender makes one untimed run, then
``--reps`` timed runs, contenders in turn, so load drift on a shared machine
hits all alike. Medians of the timed runs (best in the JSON too). Every
contender's output is checked against its peer's before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from attn_backend_xla_native import PagedConfig, XlaNativeBackend
from attn_backend_xla_native._plan import DECODE_MIN_JAXLIB, _jaxlib_at_least

# The same interleaved rounds and same-run bandwidth peer as the decode benchmark
# (this script's folder is on sys.path when it runs).
from bench_decode import in_rounds, sum_run
from plotting import progress

_BACKEND = XlaNativeBackend()


@dataclass(frozen=True)
class Shape:
    """One benchmark's sizes: ``seqs`` sequences of lengths in ``[lo, hi]``."""

    seqs: int
    lo: int
    hi: int
    page_size: int
    hq: int
    hkv: int
    d: int
    prefill: int  # rows of the mixed batch's prefill chunk

    @classmethod
    def full(cls) -> Shape:
        return cls(seqs=32, lo=1024, hi=4096, page_size=16, hq=32, hkv=8, d=128, prefill=512)

    @classmethod
    def quick(cls) -> Shape:
        return cls(seqs=4, lo=40, hi=120, page_size=16, hq=4, hkv=2, d=16, prefill=24)


@dataclass
class Pool:
    """The same K and V twice: contiguous ``[S, max_len, Hkv, D]`` (zeros past each
    length) and paged ``[num_pages, page_size, Hkv, D]`` with its page table."""

    lengths: np.ndarray
    k: np.ndarray
    v: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    table: np.ndarray

    @property
    def live_bytes(self) -> int:
        """Bytes of K and V a step must read: the live tokens' only."""
        per_token = self.k.shape[2] * self.k.shape[3] * self.k.itemsize
        return 2 * int(self.lengths.sum()) * per_token


def make_pool(shape: Shape, seed: int = 0) -> Pool:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shape.lo, shape.hi + 1, shape.seqs).astype(np.int32)
    ps = shape.page_size
    pages_of = -(-lengths // ps)
    max_len = int(pages_of.max()) * ps
    dims = (shape.seqs, max_len, shape.hkv, shape.d)
    k = rng.standard_normal(dims, np.float32)
    v = rng.standard_normal(dims, np.float32)
    for x in (k, v):
        for s, n in enumerate(lengths):
            x[s, n:] = 0  # what a contiguous cache holds past a sequence's length
    order = rng.permutation(int(pages_of.sum()))
    table = np.zeros((shape.seqs, int(pages_of.max())), np.int32)
    pool = (int(pages_of.sum()), ps, shape.hkv, shape.d)
    k_pages, v_pages = np.zeros(pool, np.float32), np.zeros(pool, np.float32)
    start = 0
    for s, n in enumerate(pages_of):
        table[s, :n] = order[start: start + n]
        start += n
        for x, pages in ((k, k_pages), (v, v_pages)):
            pages[table[s, :n]] = x[s, : n * ps].reshape(n, ps, shape.hkv, shape.d)
    return Pool(lengths, k, v, k_pages, v_pages, table)


def get_paged(shape: Shape, config: PagedConfig | None = None) -> Any:
    """xla_native's paged attention for ``shape`` (``config``: None for its defaults)."""
    return attn_backends.registry.get_paged(
        backend="xla_native", backend_options={"xla_native": config},
        num_q_heads=shape.hq, num_kv_heads=shape.hkv, head_dim=shape.d,
        page_size=shape.page_size, dtype="float32")


def _timed(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: jax.block_until_ready(fn(*args))


def contiguous_attend(q: Any, k: Any, v: Any, lengths: Any, causal: bool = True) -> Any:
    """xla_native's ``attend`` (its decode path for Tq <= 8 on jaxlib >= 0.12)."""
    call, ops = attn_backends.bind(q, k, v, causal=causal, kv_lengths=lengths)
    return _BACKEND.attend(call, q, k, v, ops)




def einsum_ceiling(q: Any, k: Any, v: Any, heads_first: bool = False) -> Any:
    """q ``[S, Hq, D]``, k and v ``[S, L, Hkv, D]`` (``heads_first``: ``[S, Hkv, L,
    D]``) -> ``[S, Hq, D]``: softmax(q k^T) v over every key, unmasked and
    unscaled (the floor of a decode step's work)."""
    s, hq, d = q.shape
    hkv = k.shape[1 if heads_first else 2]
    qg = q.reshape(s, hkv, hq // hkv, d)
    keys = "shld" if heads_first else "slhd"
    weights = jax.nn.softmax(jnp.einsum(f"shgd,{keys}->shgl", qg, k), axis=-1)
    return jnp.einsum(f"shgl,{keys}->shgd", weights, v).reshape(s, hq, d)


def _stats(times: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times),
            "timed_runs": len(times)}


def _check_close(name: str, got: Any, want: Any) -> float:
    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    if not err <= 1e-4:
        raise AssertionError(f"{name}: outputs differ from the peer's by {err} (max abs), "
                             "expected <= 1e-4; the benchmark times only agreeing contenders")
    return err


def decode_bench(shape: Shape, pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: the paged decode step against the contiguous decode path."""
    paged = get_paged(shape, args.config)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((shape.seqs, shape.hq, shape.d), np.float32))
    cache = paged.from_canonical(jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages))
    s = shape.seqs
    batch = attn_backends.PagedBatch(jnp.arange(s + 1, dtype=jnp.int32),
                                     jnp.asarray(pool.lengths), jnp.asarray(pool.table),
                                     jnp.int32(s))
    k, v, lengths = jnp.asarray(pool.k), jnp.asarray(pool.v), jnp.asarray(pool.lengths)
    paged_fn = jax.jit(paged.__call__)
    dense_fn = jax.jit(contiguous_attend)
    dense_q = q[:, None]
    err = _check_close("decode", paged_fn(q, cache, batch), dense_fn(dense_q, k, v, lengths)[:, 0])
    runs = {"sum": sum_run(*cache.arrays), "paged": _timed(paged_fn, q, cache, batch),
            "contiguous": _timed(dense_fn, dense_q, k, v, lengths),
            "einsum_ceiling": _timed(jax.jit(einsum_ceiling), q, k, v),
            "einsum_ceiling_heads_first": _timed(
                jax.jit(lambda q, k, v: einsum_ceiling(q, k, v, heads_first=True)), q,
                *(jax.block_until_ready(x.transpose(0, 2, 1, 3)) for x in (k, v)))}
    times = in_rounds(runs, args.reps, args.rounds)
    result = {name: _stats(t) for name, t in times.items()}
    pool_bytes = sum(x.nbytes for x in cache.arrays)
    gbps = pool_bytes / (result["sum"]["median_ms"] / 1e3) / 1e9
    result["sum"]["gb_per_s"] = gbps
    read = {"paged": pool.live_bytes, "contiguous": pool.live_bytes,
            "einsum_ceiling": k.nbytes + v.nbytes,
            "einsum_ceiling_heads_first": k.nbytes + v.nbytes}
    for name, nbytes in read.items():
        rate = nbytes / (result[name]["median_ms"] / 1e3) / 1e9
        result[name]["bandwidth_fraction"] = rate / gbps
    result["paged_speed_vs_contiguous"] = (result["contiguous"]["median_ms"]
                                           / result["paged"]["median_ms"])
    result["live_bytes"] = pool.live_bytes
    result["max_abs_diff"] = err
    return result


def mixed_bench(shape: Shape, pool: Pool, args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: one prefill chunk plus decode steps, paged in one call against two
    dense calls."""
    paged = get_paged(shape, args.config)
    rng = np.random.default_rng(2)
    s, chunk = shape.seqs, shape.prefill
    q = jnp.asarray(rng.standard_normal((chunk + s - 1, shape.hq, shape.d), np.float32))
    cu = np.concatenate([[0], chunk + np.arange(s)]).astype(np.int32)
    cache = paged.from_canonical(jnp.asarray(pool.k_pages), jnp.asarray(pool.v_pages))
    batch = attn_backends.PagedBatch(jnp.asarray(cu), jnp.asarray(pool.lengths),
                                     jnp.asarray(pool.table), jnp.int32(s))
    first = int(pool.lengths[0])
    k0, v0 = jnp.asarray(pool.k[:1, :first]), jnp.asarray(pool.v[:1, :first])
    k, v = jnp.asarray(pool.k[1:]), jnp.asarray(pool.v[1:])
    lengths = jnp.asarray(pool.lengths[1:])
    paged_fn = jax.jit(paged.__call__)
    prefill_fn = jax.jit(lambda q, k, v: contiguous_attend(q, k, v, None))
    decode_fn = jax.jit(contiguous_attend)
    q_pre, q_dec = q[None, :chunk], q[chunk:, None]

    def dense() -> Any:
        return (jax.block_until_ready(prefill_fn(q_pre, k0, v0)),
                jax.block_until_ready(decode_fn(q_dec, k, v, lengths)))

    pre, dec = dense()
    err = _check_close("mixed", paged_fn(q, cache, batch),
                       jnp.concatenate([pre[0], dec[:, 0]]))
    runs = {"paged": _timed(paged_fn, q, cache, batch), "dense_two_calls": dense}
    times = in_rounds(runs, args.reps, args.rounds)
    result: dict[str, Any] = {name: _stats(t) for name, t in times.items()}
    result["paged_speed_vs_dense"] = (result["dense_two_calls"]["median_ms"]
                                      / result["paged"]["median_ms"])
    result["prefill_rows"], result["decode_rows"] = chunk, s - 1
    result["max_abs_diff"] = err
    return result


def memory_bench(shape: Shape, pool: Pool, factors: tuple[int, ...],
                 config: PagedConfig | None) -> list[dict[str, int]]:
    """Part 3: temporary bytes of the compiled decode step, pool sizes ``factors``
    times the benchmark's (compile only, nothing allocated)."""
    paged = get_paged(shape, config)
    i32, s = jnp.int32, shape.seqs
    batch = attn_backends.PagedBatch(
        jax.ShapeDtypeStruct((s + 1,), i32), jax.ShapeDtypeStruct((s,), i32),
        jax.ShapeDtypeStruct(pool.table.shape, i32), jax.ShapeDtypeStruct((), i32))
    q = jax.ShapeDtypeStruct((s, shape.hq, shape.d), jnp.float32)
    rows = []
    for factor in progress(factors, desc="bench_paged"):
        num_pages = factor * pool.k_pages.shape[0]
        pages = jax.ShapeDtypeStruct((num_pages, *pool.k_pages.shape[1:]), jnp.float32)
        cache = jax.eval_shape(paged.from_canonical, pages, pages)
        analysis = jax.jit(paged.__call__).lower(q, cache, batch).compile().memory_analysis()
        rows.append({"num_pages": num_pages, "temp_bytes": int(analysis.temp_size_in_bytes),
                     "argument_bytes": int(analysis.argument_size_in_bytes)})
    return rows


def report(result: dict[str, Any]) -> str:
    """The run as Markdown rows (BENCHMARKS.md's format)."""
    d, m = result["decode"], result["mixed"]
    lines = [
        f"{result['machine']}", "",
        "| step | timed runs | jnp.sum ms (GB/s) | paged ms (% of bandwidth) "
        "| contiguous ms (% of bandwidth) | paged speed / contiguous |",
        "|---|---|---|---|---|---|",
        f"| decode | {d['paged']['timed_runs']} | {d['sum']['median_ms']:.1f} "
        f"({d['sum']['gb_per_s']:.1f}) | {d['paged']['median_ms']:.1f} "
        f"({100 * d['paged']['bandwidth_fraction']:.0f}%) | {d['contiguous']['median_ms']:.1f} "
        f"({100 * d['contiguous']['bandwidth_fraction']:.0f}%) "
        f"| {d['paged_speed_vs_contiguous']:.2f}x |", "",
        f"einsum ceiling (whole contiguous cache, unmasked): "
        f"{d['einsum_ceiling']['median_ms']:.1f} ms, "
        f"{100 * d['einsum_ceiling']['bandwidth_fraction']:.0f}% of bandwidth; "
        f"heads first: {d['einsum_ceiling_heads_first']['median_ms']:.1f} ms, "
        f"{100 * d['einsum_ceiling_heads_first']['bandwidth_fraction']:.0f}%", "",
        "| mixed batch | timed runs | paged ms | prefill + decode dense ms | paged speed / dense |",
        "|---|---|---|---|---|",
        f"| {m['prefill_rows']} + {m['decode_rows']} rows | {m['paged']['timed_runs']} "
        f"| {m['paged']['median_ms']:.1f} | {m['dense_two_calls']['median_ms']:.1f} "
        f"| {m['paged_speed_vs_dense']:.2f}x |", "",
        "| num_pages | temp bytes | argument bytes |", "|---|---|---|",
    ]
    lines += [f"| {r['num_pages']} | {r['temp_bytes']} | {r['argument_bytes']} |"
              for r in result["memory"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, one round")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (quick: 1)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip", type=lambda s: s.split(","), default=[],
                        help="parts to skip: decode, mixed, memory")
    parser.add_argument("--pages-per-block", type=int, default=None,
                        help="xla_native's PagedConfig (default: PagedConfig.default_for)")
    parser.add_argument("--rows-per-tile", type=int, default=None)
    parser.add_argument("--tiles-per-group", type=int, default=None)
    args = parser.parse_args(argv)
    args.config = None
    if args.pages_per_block or args.rows_per_tile or args.tiles_per_group:
        default = PagedConfig.default_for(get_paged(Shape.full()).call)
        args.config = PagedConfig(args.pages_per_block or default.pages_per_block,
                                  args.rows_per_tile or default.rows_per_tile,
                                  args.tiles_per_group or default.tiles_per_group)
    args.rounds = args.rounds or (1 if args.quick else 5)
    shape = Shape.quick() if args.quick else Shape.full()
    pool = make_pool(shape)
    result: dict[str, Any] = {
        "machine": (f"{os.cpu_count()} cores; load average at the start "
                    f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; jax {jax.__version__}"),
        "shape": shape.__dict__, "lengths": pool.lengths.tolist(),
        "num_pages": int(pool.k_pages.shape[0]), "rounds": args.rounds, "reps": args.reps,
        "contiguous_is_decode_path": _jaxlib_at_least(DECODE_MIN_JAXLIB),
        "paged_config": None if args.config is None else args.config.__dict__,
    }
    if "decode" not in args.skip:
        result["decode"] = decode_bench(shape, pool, args)
    if "mixed" not in args.skip:
        result["mixed"] = mixed_bench(shape, pool, args)
    if "memory" not in args.skip:
        result["memory"] = memory_bench(shape, pool, (1, 2, 4, 8), args.config)
    result["load_average_end"] = list(os.getloadavg())
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    elif not args.skip:
        print(report(result))
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "lengths"}, indent=1))
    return result


if __name__ == "__main__":
    main()
