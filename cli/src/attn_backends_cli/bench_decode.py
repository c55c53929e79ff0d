"""`attn-backends bench --decode`: decode steps against a KV cache.

A small version of benchmarks/bench_decode.py for any installed backend:
one query position per sequence, causal (aligned bottom-right: it sees the
whole cache), ``kv_lengths`` drawn in [Tk/2, Tk]. Such a call is bound by
reading K and V, so next to its time each backend gets its share of the
bandwidth a jitted ``jnp.sum`` over the same K and V reaches in the same
run (``t_sum / t``), and, as ``bench`` does, its ratio to ``reference``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attn_backends.contract.arguments import bind


@dataclass(frozen=True)
class DecodeRow:
    """One timing: backend (or ``jnp.sum``), cache length, best ms, the share
    of the ``jnp.sum`` bandwidth, and reference ms / this ms."""

    backend: str
    kv_len: int
    ms: float
    bandwidth_share: float
    vs_reference: float | None = None


def _best(fn: Callable[[], Any], reps: int) -> float:
    fn()  # compiles and warms up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def run_decode(
    registry: Any,
    platform: str,
    *,
    backends: Sequence[str] | None = None,
    kv_lens: Sequence[int] = (1024, 4096),
    batch: int = 4,
    heads: int = 8,
    head_dim: int = 64,
    dtype: str = "float32",
    reps: int = 5,
) -> list[DecodeRow]:
    """Best-of-``reps`` decode steps: q ``[batch, 1, heads, head_dim]``, K and
    V ``[batch, Tk, heads // 4 (GQA), head_dim]`` (``heads`` kv heads if not
    divisible by 4), for each Tk in ``kv_lens``."""
    import jax
    import jax.numpy as jnp

    kv_heads = heads // 4 if heads % 4 == 0 else heads
    names = list(backends) if backends else sorted(registry.backends)
    total = jax.jit(lambda k, v: jnp.sum(k) + jnp.sum(v))
    from tqdm import tqdm

    rows = []
    # a progress bar on stderr, none when stderr is not a terminal
    for tk in tqdm(kv_lens, desc="bench --decode", unit="cache", disable=None, file=sys.stderr):
        keys = jax.random.split(jax.random.key(tk), 4)
        q = jax.random.normal(keys[0], (batch, 1, heads, head_dim), dtype)
        k, v = (jax.random.normal(key, (batch, tk, kv_heads, head_dim), dtype) for key in keys[1:3])
        lengths = jax.random.randint(keys[3], (batch,), tk // 2, tk + 1)
        call, _ = bind(q, k, v, causal=True, kv_lengths=lengths)
        sum_ms = _best(lambda k=k, v=v: jax.block_until_ready(total(k, v)), reps)
        timed = {}
        for name in names:
            backend = registry.backend(name)
            if backend.capabilities.unmet(call, platform) or backend.check(call):
                continue
            att = registry.get(device=platform, backend=name, fallback="silent")
            fn = jax.jit(lambda q, k, v, n, att=att: att(q, k, v, causal=True, kv_lengths=n))
            args = (q, k, v, lengths)
            timed[name] = _best(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), reps)
        if not timed:
            continue
        rows.append(DecodeRow("jnp.sum", tk, sum_ms, 1.0))
        ref = timed.get("reference")
        for name, ms in sorted(timed.items()):
            rows.append(DecodeRow(name, tk, ms, sum_ms / ms, None if ref is None else ref / ms))
    return rows
