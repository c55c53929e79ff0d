"""Gemma 3 270M through the registry on this machine's CPU: prefill, decode, the share of
a decode step spent in attention, a local layer's decode time against its context,
memory, and the bandwidth a decode step reaches.

    python benchmarks/bench_gemma3.py --json ours.json [--dtype float32 bfloat16] [--quick]
    python benchmarks/bench_gemma3.py --report ours.json peers.json   # BENCHMARKS.md's tables

(``make bench-gemma3`` runs both, with the peers' script between them.)

- prefill tokens/s at 128, 2,048 and 8,192 prompt tokens, two ways: the dense
  prefill (``model.logits(ids, last=1)``: one dense attention call per layer)
  and the serving engine's (one request, prompt chunks of 512 rows through the
  paged contract). Compilation excluded (a first call at the same length).
- decode tokens/s for 1 and 16 concurrent requests at contexts 512 and 8,192:
  the engine's step program on a batch of decode rows whose sequences already
  hold ``context`` positions (their pages allocated; K and V zeros: no step's
  work depends on their values), the median of several steps.
- attention's share of that step: the same batch's paged write-then-attend of
  one local and one global layer, timed alone (jitted), times 15 and 3 layers,
  over the step's time.
- a local (windowed) layer's and a global layer's write-then-attend for one
  request at contexts 1,024 to 8,192: the local one should stay flat.
- memory: the compiled decode step's ``memory_analysis()`` (arguments: weights
  and caches; temporaries), and the process's peak RSS.
- bandwidth: a jitted sum over every weight (the bytes a batch-1 decode step
  must read) gives this run's attainable GB/s; each decode figure is also the
  share of it that its bytes read per step reach.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from plotting import progress

PREFILL = (128, 2048, 8192)
DECODE = ((1, 512), (1, 8192), (16, 512), (16, 8192))
FLAT = (1024, 2048, 4096, 8192)
QUICK = {"prefill": (64, 256), "decode": ((1, 128), (2, 128)), "flat": (256, 512)}


def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()  # compiles (or loads) first
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prompt(model: Any, tokens: int) -> list[int]:
    text = ("The river ran past the old mill, where the miller kept seven cats and a dog "
            "that barked at every boat coming down from the hills in spring. ")
    ids = model.tokenize(text * (tokens // 20 + 1))
    return ids[:tokens]


def prefill(model: Any, sizes: tuple[int, ...]) -> dict[str, dict[str, float]]:
    dense, served = {}, {}
    for n in progress(sizes, desc="prefill"):
        ids = _prompt(model, n)
        dense[str(n)] = n / _median_seconds(lambda ids=ids: model.logits(ids, last=1), 1)
        engine = model.engine(n + 16, max_seqs=1, chunk_budget=512)
        from attn_gemma3 import Request

        engine.run([Request(0, tuple(ids), 1)])  # compiles each row bucket once
        engine.steps.clear()
        engine.run([Request(1, tuple(ids), 1)])
        served[str(n)] = engine.rates()[0]
        print(f"prefill {n}: dense {dense[str(n)]:.0f} tokens/s, served "
              f"{served[str(n)]:.0f} tokens/s", flush=True)
    return {"dense": dense, "served": served}


def _decode_state(model: Any, seqs: int, context: int) -> tuple[Any, tuple[Any, ...]]:
    """An engine whose ``seqs`` sequences hold ``context`` positions, and the
    arguments of its step program for one decode row each."""
    page = 16
    engine = model.engine(context + page, max_seqs=seqs, page_size=page)
    width = engine.table_width
    table = np.arange(seqs * width, dtype=np.int32).reshape(seqs, width)
    rows = max(8, seqs)
    positions = np.zeros(rows, np.int32)
    positions[:seqs] = context
    slots = np.full(rows, -1, np.int32)
    slots[:seqs] = table[:, context // page] * page + context % page
    cu = np.full(seqs + 1, seqs, np.int32)
    cu[:seqs] = np.arange(seqs)
    batch = attn_backends.PagedBatch(jnp.asarray(cu), jnp.full(seqs, context + 1, jnp.int32),
                                     jnp.asarray(table), jnp.int32(seqs))
    args = (jnp.full(rows, 1000, jnp.int32), jnp.asarray(positions), jnp.asarray(slots), batch,
            jnp.arange(seqs, dtype=jnp.int32))
    return engine, args


def _step(model: Any, engine: Any, args: tuple[Any, ...]) -> tuple[float, Any, Any]:
    """(median seconds of the engine's decode step on ``args``, the caches after,
    the compiled step's memory analysis); the caches donated and fed back."""
    compiled = engine.program.lower(model.params, engine.caches, *args).compile()
    state = {"caches": engine.caches}

    def once() -> Any:
        new, state["caches"] = compiled(model.params, state["caches"], *args)
        return new

    seconds = _median_seconds(once, 5)
    return seconds, state["caches"], compiled.memory_analysis()


def decode(model: Any, shapes: tuple[tuple[int, int], ...], weight_bytes: int,
           bandwidth: float) -> dict[str, Any]:
    from attn_gemma3.model import window_of

    out: dict[str, Any] = {"tokens_per_s": {}, "attention_share": {}, "bandwidth_share": {},
                           "memory_mib": {}}
    cfg = model.cfg
    kinds = [window_of(cfg, layer) for layer in range(cfg.layers)]
    for seqs, context in progress(shapes, desc="decode"):
        key = f"{seqs}@{context}"
        engine, args = _decode_state(model, seqs, context)
        seconds, caches, memory = _step(model, engine, args)
        slots, batch = args[2], args[3]
        attention = sum(kinds.count(window) * _layer_seconds(
            model, paged, caches[kinds.index(window)], slots, batch)
            for window, paged in engine.paged.items())
        del caches, engine
        out["tokens_per_s"][key] = seqs / seconds
        out["attention_share"][key] = attention / seconds
        # bytes a step must read: every weight once, and each sequence's K and V
        # (a global layer all its context, a local one its window)
        seen = sum(context + 1 if w is None else min(context + 1, w + 1) for w in kinds)
        kv = seqs * seen * cfg.kv_heads * cfg.head_dim * 2 * jnp.dtype(model.dtype).itemsize
        out["bandwidth_share"][key] = (weight_bytes + kv) / seconds / bandwidth
        out["memory_mib"][key] = {"arguments": memory.argument_size_in_bytes / 2**20,
                                  "temporaries": memory.temp_size_in_bytes / 2**20}
        print(f"decode {key}: {seqs / seconds:.1f} tokens/s ({1e3 * seconds:.1f} ms a step), "
              f"attention {out['attention_share'][key]:.0%} of it, "
              f"{out['bandwidth_share'][key]:.0%} of the measured bandwidth; compiled step: "
              f"{out['memory_mib'][key]['arguments']:.0f} MiB arguments, "
              f"{out['memory_mib'][key]['temporaries']:.0f} MiB temporaries", flush=True)
    return out


def _layer_seconds(model: Any, paged: Any, cache: Any, slots: Any, batch: Any) -> float:
    """One layer's paged write-then-attend of the batch's rows, jitted alone, its
    cache donated and fed back as the engine's step does (no copy of the pool)."""
    cfg = model.cfg
    q = jnp.zeros((len(slots), cfg.heads, cfg.head_dim), model.dtype)
    kv = jnp.zeros((len(slots), cfg.kv_heads, cfg.head_dim), model.dtype)

    def layer(q: Any, kv: Any, cache: Any) -> tuple[Any, Any]:
        cache = paged.write(cache, kv, kv, slots)
        return paged(q, cache, batch), cache

    program = jax.jit(layer, donate_argnums=2)
    state = {"cache": cache}

    def once() -> Any:
        out, state["cache"] = program(q, kv, state["cache"])
        return out

    return _median_seconds(once, 7)


def flat(model: Any, contexts: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """ms of one layer's paged write-then-attend, one request decoding at each context."""
    from attn_gemma3.model import window_of

    out: dict[str, dict[str, float]] = {"local": {}, "global": {}}
    cfg = model.cfg
    for context in progress(contexts, desc="layers"):
        engine, (tokens, _, slots, batch, _) = _decode_state(model, 1, context)
        for window, paged in engine.paged.items():
            cache = engine.caches[[window_of(cfg, i) for i in range(cfg.layers)].index(window)]
            seconds = _layer_seconds(model, paged, cache, slots, batch)
            out["local" if window is not None else "global"][str(context)] = 1e3 * seconds
        print(f"one layer's decode attention at context {context}: local "
              f"{out['local'][str(context)]:.2f} ms, global {out['global'][str(context)]:.2f} ms",
              flush=True)
        del engine
    return out


def run(dtype: str, quick: bool, backend: str | None) -> dict[str, Any]:
    import attn_gemma3

    start = time.perf_counter()
    model = attn_gemma3.load(dtype=dtype, backend=backend)
    loaded = time.perf_counter() - start
    weights = jax.tree.leaves(model.params)
    weight_bytes = sum(w.size * w.dtype.itemsize for w in weights)
    total = jax.jit(lambda ws: sum(jnp.sum(w.astype(jnp.float32)) for w in ws))
    bandwidth = weight_bytes / _median_seconds(lambda: total(weights), 5)
    print(f"{dtype}: loaded in {loaded:.1f} s; weights {weight_bytes / 2**20:.0f} MiB, a sum "
          f"over them reads {bandwidth / 1e9:.1f} GB/s", flush=True)
    sizes = QUICK if quick else {"prefill": PREFILL, "decode": DECODE, "flat": FLAT}
    engine = model.engine(64)
    result = {
        "backends": engine.backends(), "load_seconds": loaded,
        "weight_mib": weight_bytes / 2**20, "bandwidth_gb_s": bandwidth / 1e9,
        "prefill": prefill(model, sizes["prefill"]),
        "decode": decode(model, sizes["decode"], weight_bytes, bandwidth),
        "layer_decode_ms": flat(model, sizes["flat"])}
    del engine
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--report", nargs=2, metavar=("OURS", "PEERS"),
                        help="print BENCHMARKS.md's tables from two JSON files")
    args = parser.parse_args()
    if args.report:
        from bench_gemma3_report import report

        print(report(*(json.load(open(path)) for path in args.report)))
        return
    figures = {"machine": {"cpu": _cpu(), "jax": jax.__version__},
               **{dtype: run(dtype, args.quick, args.backend) for dtype in args.dtype}}
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
