"""`attn-backends bench`: time installed backends on the local device.

A small version of benchmarks/bench_xla_native.py for any installed backend:
forward and forward+backward of one causal call per sequence length, each
timed back to back after an untimed run that compiles and warms it up (a
run right after another program pays for that program's freed memory and
busy threads), best time kept, and every figure also given as a ratio to
the ``reference`` backend measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from attn_backends.contract.arguments import bind
from attn_backends.contract.errors import AttnBackendsError

from .text import table as _table


@dataclass(frozen=True)
class BenchRow:
    """One timing: backend, sequence length, pass ("fwd" / "fwd+bwd"), best ms."""

    backend: str
    seq: int
    kind: str
    ms: float
    vs_reference: float | None = None


def run(
    registry: Any,
    platform: str,
    *,
    backends: Sequence[str] | None = None,
    seqs: Sequence[int] = (512, 1024, 2048),
    heads: int = 8,
    head_dim: int = 64,
    dtype: str = "float32",
    causal: bool = True,
    reps: int = 5,
) -> list[BenchRow]:
    """Best-of-``reps`` times for q/k/v ``[1, S, heads, head_dim]`` on ``platform``."""
    import jax
    import jax.numpy as jnp

    names = list(backends) if backends else sorted(registry.backends)
    jobs = []
    for seq in seqs:
        q = jax.random.normal(jax.random.key(seq), (1, seq, heads, head_dim), dtype)
        call, _ = bind(q, q, q, causal=causal)
        for name in names:
            backend = registry.backend(name)
            if backend.capabilities.unmet(call, platform) or backend.check(call):
                continue
            att = registry.get(device=platform, backend=name, fallback="silent")
            fwd = jax.jit(lambda q, k, v, att=att: att(q, k, v, causal=causal))
            loss = lambda q, k, v, att=att: att(q, k, v, causal=causal).astype(jnp.float32).sum()  # noqa: E731
            both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            jobs += [(name, seq, "fwd", fwd, q), (name, seq, "fwd+bwd", both, q)]
    from tqdm import tqdm

    best: dict[tuple[str, int, str], float] = {}
    # a progress bar on stderr, none when stderr is not a terminal
    with tqdm(total=len(jobs) * (reps + 1), desc="bench", unit="run", disable=None,
              file=sys.stderr) as bar:
        for name, seq, kind, fn, q in jobs:
            for rep in range(reps + 1):  # rep 0 compiles and warms up
                bar.set_postfix_str(f"{name} S={seq} {kind}" + ("" if rep else " (compile)"))
                start = time.perf_counter()
                jax.block_until_ready(fn(q, q, q))
                elapsed = 1e3 * (time.perf_counter() - start)
                if rep:
                    key = (name, seq, kind)
                    best[key] = min(best.get(key, float("inf")), elapsed)
                bar.update()
    rows = []
    for (name, seq, kind), ms in sorted(
        best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])
    ):
        ref = best.get(("reference", seq, kind))
        rows.append(BenchRow(name, seq, kind, ms, None if ref is None else ref / ms))
    return rows


def as_dicts(rows: Sequence[BenchRow]) -> list[dict[str, Any]]:
    """JSON-friendly rows."""
    return [asdict(r) for r in rows]


def setup_label(
    *, heads: int, head_dim: int, dtype: str, causal: bool, platform: str,
    device_kind: str | None,
) -> str:
    """What was timed, for a plot title: shape, dtype, mask and device."""
    mask = "causal" if causal else "no mask"
    device = f"{platform} ({device_kind})" if device_kind else platform
    return f"q/k/v [1, S, {heads}, {head_dim}] {dtype} {mask}, {device}"


def figure(rows: Sequence[BenchRow], setup: str = "") -> Any:
    """A matplotlib Figure: time against sequence length, one panel per pass.

    The x axis is logarithmic, ticked and labelled with exactly the lengths
    that were run (no ``3x10^2`` log ticks); each panel's title is the pass
    and ``setup`` (see :func:`setup_label`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise AttnBackendsError(
            f"--plot needs matplotlib, which is not installed ({exc}): "
            "pip install 'attn-backends[plot]'"
        ) from exc
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
    for ax, kind in zip(axes, ("fwd", "fwd+bwd"), strict=True):
        for name in sorted({r.backend for r in rows}):
            pts = sorted((r.seq, r.ms) for r in rows if r.backend == name and r.kind == kind)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set(xlabel="sequence length S", ylabel="ms (best)", xscale="log", yscale="log")
        ax.set_title(f"{kind}\n{setup}" if setup else kind, fontsize=9)
        seqs = sorted({r.seq for r in rows if r.kind == kind})
        ax.minorticks_off()  # log minor ticks would label 3x10^2 and the like
        ax.set_xticks(seqs, [str(s) for s in seqs])
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    return fig


def plot(rows: Sequence[BenchRow], path: str, setup: str = "") -> None:
    """Write :func:`figure` of ``rows`` as a PNG to ``path``."""
    fig = figure(rows, setup)  # first: it explains a missing matplotlib
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def command(args: argparse.Namespace, registry: Any) -> int:
    """`attn-backends bench ...` with its parsed ``args``: print the table (or JSON,
    or a plot); 2 when nothing could be timed."""
    from attn_backends.contract.environment import resolve

    platform, present = resolve(args.device)
    if not present:
        print(f"attn-backends bench: JAX sees no {platform} here", file=sys.stderr)
        return 2
    seqs = list(args.seq)
    if args.decode:
        return _decode_command(args, registry, platform, seqs)
    rows = run(
        registry, platform,
        backends=args.backends.split(",") if args.backends else None,
        seqs=seqs, heads=args.heads, head_dim=args.head_dim,
        dtype=args.dtype, causal=not args.no_causal, reps=args.reps,
    )
    if not rows:
        print("attn-backends bench: nothing was timed: none of the backends asked for can "
              "serve these calls here (attn-backends explain says why)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_dicts(rows), indent=2))
    else:
        table = [[r.backend, str(r.seq), r.kind, f"{r.ms:.2f}",
                  "-" if r.vs_reference is None else f"{r.vs_reference:.2f}x"] for r in rows]
        print(_table(table, ["backend", "S", "pass", "best ms", "reference / backend"]))
    if args.plot:
        from attn_backends.contract.environment import device_kind

        plot(rows, args.plot, setup_label(
            heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
            causal=not args.no_causal, platform=platform, device_kind=device_kind(platform)))
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _decode_command(args: argparse.Namespace, registry: Any, platform: str,
                    kv_lens: list[int]) -> int:
    from .bench_decode import run_decode

    rows = run_decode(
        registry, platform, backends=args.backends.split(",") if args.backends else None,
        kv_lens=kv_lens, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
        reps=args.reps,
    )
    if not rows:
        print("attn-backends bench --decode: nothing was timed: none of the backends asked "
              "for can serve these calls here (attn-backends explain says why)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    table = [[r.backend, str(r.kv_len), f"{r.ms:.2f}", f"{100 * r.bandwidth_share:.0f}%",
              "-" if r.vs_reference is None else f"{r.vs_reference:.2f}x"] for r in rows]
    print(_table(table, ["backend", "Tk", "best ms", "of jnp.sum bandwidth",
                         "reference / backend"]))
    return 0
