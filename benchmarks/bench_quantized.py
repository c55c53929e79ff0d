"""Quantized KV caches (issue 48): what an int8 or float8 cache costs and saves.

Run from the repo root in .venv (make install):

    .venv/bin/python benchmarks/bench_quantized.py            # decode table, then Gemma 3
    .venv/bin/python benchmarks/bench_quantized.py --quick    # small shapes, short text

1. Paged decode on native_cpu: 32 sequences of 4,096 keys each, pages of 16,
   8 query / 2 kv heads, head dim 128, one query row per sequence (a decode
   step), the cache in float32 (q float32), bfloat16, int8, float8_e4m3fn and
   float8_e5m2 (q bfloat16), with xla_native beside it. Each step reads the
   whole cache (every position is live): its bytes are the cache's arrays'
   (values and scales). Bandwidth is those bytes over the step's median time,
   as a share of a jnp.sum's over a 256 MiB float32 array measured in the same
   rounds (the read bandwidth this process gets; the table's heading gives
   the spread of its rounds), and of the same jnp.sum run alone, 20 times back
   to back (on 2026-12-05 its rounds spread over 30-74 GB/s within one run,
   and alone it read 36-60 GB/s from run to run, 64-79 in a process of its
   own). Rounds alternate the contenders, so a busy machine slows all of them
   alike; each contender runs WARM_RUNS times untimed before its timed run, so
   that none is timed in the wake of the one before it. native_cpu runs each step twice: over the
   random pages, and with every page table cycling over 32 pages (rows
   "native_cpu, pages in L2": the same keys' worth of arithmetic with its
   bytes in L2), whose share is the most that overlapping the reads with the
   arithmetic could reach.
2. Gemma 3 270M (attn_gemma3, the PyPI package's GGUF): the perplexity of a
   fixed text (examples/gemma3/texts/python_execution_model.txt, 5,062 tokens:
   the Python 3.12.1 Language Reference's "Execution model" and "The import
   system") scored through the engine's paged caches, in float32 with a
   float32 cache and in bfloat16 with a bfloat16, int8, float8_e4m3fn and
   float8_e5m2 cache; the greedy completions (32 tokens) of the peer fixture's
   six prompts with each bfloat16-model cache against the bfloat16 cache's,
   token for token; the bytes a token keeps and the requests of 4,096 tokens a
   256 MiB cache holds.

The machine's cores may be shared with other work: read the ratios of one run,
never the absolute times of two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from plotting import progress

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "gemma3" / "texts" / "python_execution_model.txt"
FIXTURE = ROOT / "examples" / "gemma3" / "peer" / "transformers_fixture.json"
#: (query dtype, cache dtype or None: the query's) of the decode table.
CACHES = (("float32", None), ("bfloat16", None), ("bfloat16", "int8"),
          ("bfloat16", "float8_e4m3fn"), ("bfloat16", "float8_e5m2"))
BUDGET = 256 << 20
#: native_cpu's decode step again with each page table cycling over this many
#: pages (K and V: 512 KiB in bfloat16, 264 KiB quantized; this machine's L2
#: holds 1 MiB a core), labelled HOT.
HOT_PAGES = 32
HOT = "native_cpu, pages in L2"
#: Untimed runs of each contender before its timed one, every round: a
#: native_cpu step right after xla_native's float8 step (100 ms) ran 1.6-1.9x
#: slower for its next 3-5 runs (2026-12-05: 5.1-6.5 ms against 3.3-3.6 ms
#: with 1 or 3 untimed runs, 3.37 against 3.34 with 6).
WARM_RUNS = 6


def _cache(paged: Any, pages: int, rng: np.random.Generator) -> Any:
    """A full pool of random K and V in ``paged``'s cache (values and scales)."""
    call = paged.call
    shape = (pages, call.page_size, call.kv_heads, call.head_dim)
    if call.kv_dtype is None:
        k = jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(call.dtype)
        return paged.from_canonical(k, k[::-1])
    values = jnp.asarray(rng.integers(-127, 128, size=shape).astype(np.int8))
    if call.kv_dtype != "int8":
        values = (values.astype(jnp.float32) / 8).astype(call.kv_dtype)
    scales = jnp.asarray(rng.uniform(0.01, 0.02, size=shape[:3]).astype(np.float32))
    return paged.from_canonical(values, values[::-1], scales, scales[::-1])


def decode_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    seqs, keys = (8, 1024) if args.quick else (32, 4096)
    page, hq, hkv, dim = 16, 8, 2, 128
    pages = seqs * keys // page
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(pages).reshape(seqs, keys // page).astype(np.int32))
    batch = attn_backends.PagedBatch(jnp.arange(seqs + 1, dtype=jnp.int32),
                                     jnp.full((seqs,), keys, jnp.int32), table, jnp.int32(seqs))
    # The arithmetic's floor: every sequence's table cycling over HOT_PAGES
    # pages, so a step reads its whole cache's worth of keys from L2.
    hot = jnp.asarray((np.arange(pages) % HOT_PAGES).reshape(seqs, keys // page).astype(np.int32))
    hot_batch = batch._replace(page_table=hot)
    registry = attn_backends.Registry(probe=None)
    runs, sizes = {}, {}
    for dtype, kv_dtype in progress(CACHES, desc="caches"):
        for backend in ("native_cpu", "xla_native"):
            paged = registry.get_paged(device="cpu", backend=backend, num_q_heads=hq,
                                       num_kv_heads=hkv, head_dim=dim, page_size=page,
                                       dtype=dtype, kv_dtype=kv_dtype, max_q_len=1)
            cache = _cache(paged, pages, rng)
            q = jnp.asarray(rng.normal(size=(seqs, hq, dim)).astype(np.float32)).astype(dtype)
            step = jax.jit(paged.__call__).lower(q, cache, batch).compile()
            tables = {backend: batch}
            if backend == "native_cpu":
                tables[HOT] = hot_batch
            for label, b in tables.items():
                name = (label, kv_dtype or dtype)
                runs[name] = (lambda s=step, c=cache, q=q, b=b: s(q, c, b))
                sizes[name] = sum(a.nbytes for a in cache.arrays)
    probe = jnp.ones(BUDGET // 4, jnp.float32)
    total = jax.jit(jnp.sum).lower(probe).compile()
    runs[("probe", "jnp.sum")] = lambda: total(probe)
    alone = _back_to_back(runs[("probe", "jnp.sum")], 10)
    times: dict[Any, list[float]] = {n: [] for n in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            for _ in range(WARM_RUNS):  # warm, then timed
                run().block_until_ready()
            start = time.perf_counter()
            run().block_until_ready()
            times[name].append(time.perf_counter() - start)
    alone = BUDGET / statistics.median(alone + _back_to_back(runs[("probe", "jnp.sum")], 10))
    med = {n: statistics.median(t) for n, t in times.items()}
    bandwidth = BUDGET / med[("probe", "jnp.sum")]
    sums = times[("probe", "jnp.sum")]
    spread = (BUDGET / max(sums), BUDGET / min(sums))
    rows = []
    for (backend, stored), seconds in med.items():
        if backend == "probe":
            continue
        rows.append({"backend": backend, "cache": stored, "ms": seconds * 1e3,
                     "bytes": sizes[(backend, stored)],
                     "share": sizes[(backend, stored)] / seconds / bandwidth,
                     "share_alone": sizes[(backend, stored)] / seconds / alone,
                     "vs_bf16": seconds / med[(backend, "bfloat16")]})
    print(f"\nPaged decode: {seqs} sequences x {keys} keys, pages of {page}, {hq}/{hkv} heads, "
          f"D {dim}; median of {args.rounds} rounds; jnp.sum reads {bandwidth / 1e9:.1f} GB/s "
          f"(its rounds {spread[0] / 1e9:.1f}-{spread[1] / 1e9:.1f}), {alone / 1e9:.1f} GB/s "
          f"alone (20 runs back to back, half before the rounds, half after). Rows '{HOT}': "
          f"the same step, every table cycling over {HOT_PAGES} pages (read from L2): its share "
          f"is the most any overlap of reading and arithmetic could reach")
    print("\n| backend | cache | step ms | MiB read | GB/s | share of jnp.sum's | "
          "share of jnp.sum's alone | vs bfloat16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['cache']} | {r['ms']:.2f} | {r['bytes'] / 2**20:.0f} "
              f"| {r['bytes'] / r['ms'] / 1e6:.1f} | {r['share']:.0%} | {r['share_alone']:.0%} "
              f"| {r['vs_bf16']:.2f}x |")
    return rows


def _back_to_back(run: Any, n: int) -> list[float]:
    """Seconds of ``n`` runs of ``run`` one after another (after one untimed)."""
    run().block_until_ready()
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        run().block_until_ready()
        seconds.append(time.perf_counter() - start)
    return seconds


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def gemma_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    import attn_gemma3

    text = TEXT.read_text()
    prompts = [p["text"] for p in json.loads(FIXTURE.read_text())["prompts"]]
    new = 8 if args.quick else 32
    rows, reference = [], None
    for dtype, caches in (("float32", [None]),
                          ("bfloat16", [None, "int8", "float8_e4m3fn", "float8_e5m2"])):
        model = attn_gemma3.load(None, dtype)
        ids = model.tokenize(text)[: 600 if args.quick else None]
        for kv_dtype in caches:
            start = time.perf_counter()
            ppl = model.perplexity(ids, kv_dtype=kv_dtype)
            engine = model.last_engine
            tokens = model.generate_ids([model.tokenize(p) for p in prompts], new,
                                        kv_dtype=kv_dtype)
            if dtype == "bfloat16" and kv_dtype is None:
                reference = tokens
            # Tokens equal up to each completion's first difference, and completions
            # equal whole, against the bfloat16 cache's.
            same = None if dtype != "bfloat16" else (
                sum(_common_prefix(t, r) for t, r in zip(tokens, reference, strict=True)),
                sum(t == r for t, r in zip(tokens, reference, strict=True)))
            rows.append({"model": dtype, "cache": engine.kv_dtype, "tokens": len(ids),
                         "perplexity": ppl, "bytes_per_token": engine.bytes_per_token(),
                         "requests_in_256MiB": engine.requests_in(BUDGET, 4096),
                         "greedy_equal": same, "greedy_total": sum(map(len, reference or [])),
                         "backends": engine.backends(),
                         "seconds": time.perf_counter() - start})
    base = next(r["perplexity"] for r in rows if r["model"] == "bfloat16"
                and r["cache"] == "bfloat16")
    print(f"\nGemma 3 270M: perplexity over {rows[0]['tokens']} tokens of "
          f"{TEXT.name}; greedy: {len(prompts)} prompts x {new} tokens against the "
          "bfloat16 cache's")
    print("\n| model | cache | perplexity | vs bfloat16 cache | bytes / token "
          "| requests of 4,096 in 256 MiB | greedy tokens before the first difference |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        equal = "-" if r["greedy_equal"] is None else (
            f"{r['greedy_equal'][0]}/{r['greedy_total']} "
            f"({r['greedy_equal'][1]}/{len(prompts)} completions whole)")
        print(f"| {r['model']} | {r['cache']} | {r['perplexity']:.4f} "
              f"| {r['perplexity'] / base - 1:+.2%} | {r['bytes_per_token']:,.0f} "
              f"| {r['requests_in_256MiB']} | {equal} |")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a short text")
    parser.add_argument("--rounds", type=int, default=None, help="default 9 (quick: 2)")
    parser.add_argument("--skip", choices=("decode", "gemma"), default=None)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 9)
    from attn_backend_native_cpu._library import kernel_isa

    out: dict[str, Any] = {"jax": jax.__version__, "kernel_isa": kernel_isa()}
    if args.skip != "decode":
        out["decode"] = decode_table(args)
    if args.skip != "gemma":
        out["gemma"] = gemma_table(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
