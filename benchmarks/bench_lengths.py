"""Dense attention against the sequence length, and a decode step against the cache's
length: CPU backends beside PyTorch's SDPA, as tables and two plots (issue 59).

    .venv/bin/python benchmarks/bench_lengths.py --runtime ours --json ours.json
    .venv-peer/bin/python benchmarks/bench_lengths.py --runtime torch --json torch.json
    .venv/bin/python benchmarks/bench_lengths.py --report ours.json torch.json \\
        --plot benchmarks/plots

(``make bench-lengths`` runs the three.) Each runtime runs in its own process
(no environment here holds both jax and torch), on the machine's 2 cores.

* Ours: ``attn-backends bench``'s own timing (``attn_backends_cli.bench.run``):
  q/k/v ``[1, S, 8, 64]`` float32, causal, the forward and the gradient of the
  output's sum, best of ``--reps`` after one untimed run; and ``bench --decode``'s
  (``run_decode``): q ``[4, 1, 8, 64]``, K and V ``[4, Tk, 2, 64]``, each
  sequence's ``kv_lengths`` drawn in ``[Tk/2, Tk]``, beside a jitted ``jnp.sum``
  over the same K and V (what reading them costs).
* PyTorch: ``torch.nn.functional.scaled_dot_product_attention`` on the same
  shapes in its own layout ``[B, H, T, D]``, ``is_causal=True``, the same loop
  (best of ``--reps`` after one untimed run), ``torch.set_num_threads(2)``; its
  decode step gives every sequence 3/4 Tk keys (the mean of ours' draws)
  through a boolean mask, ``enable_gqa=True``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from plotting import axes, log_lengths, progress, save, stamp  # noqa: E402

SEQS = (256, 512, 1024, 2048, 4096)
KV_LENS = (1024, 2048, 4096, 8192, 16384)
HEADS, HEAD_DIM, BATCH = 8, 64, 4
BACKENDS = ("native_cpu", "xla_native", "tokamax_xla", "reference")
THREADS = 2
TORCH = "torch sdpa"


def ours(backends: Sequence[str], reps: int) -> dict[str, Any]:
    """Dense and decode rows of ``backends`` on cpu (the CLI's own timing)."""
    from attn_backends import registry
    from attn_backends_cli.bench import as_dicts, run
    from attn_backends_cli.bench_decode import run_decode

    dense = run(registry, "cpu", backends=backends, seqs=SEQS, heads=HEADS, head_dim=HEAD_DIM,
                reps=reps)
    decode = run_decode(registry, "cpu", backends=backends, kv_lens=KV_LENS, batch=BATCH,
                        heads=HEADS, head_dim=HEAD_DIM, reps=reps)
    return {"run": stamp(), "dense": as_dicts(dense),
            "decode": [{"backend": r.backend, "kv_len": r.kv_len, "ms": r.ms} for r in decode]}


def _best_ms(fn: Callable[[], Any], reps: int) -> float:
    # attn_backends_cli.bench_decode's loop, for PyTorch: its venv (.venv-peer) has
    # no attn_backends to import that module from.
    fn()  # untimed: warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def torch_rows(reps: int) -> dict[str, Any]:
    """The same cases through PyTorch's SDPA."""
    import torch

    torch.set_num_threads(THREADS)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dense = []
    for seq in progress(SEQS, desc="torch dense"):
        q = torch.randn(1, HEADS, seq, HEAD_DIM, requires_grad=True)

        def forward(q: Any = q) -> None:
            with torch.no_grad():
                sdpa(q, q, q, is_causal=True)

        def both(q: Any = q) -> None:
            q.grad = None
            sdpa(q, q, q, is_causal=True).sum().backward()

        dense += [{"backend": TORCH, "seq": seq, "kind": kind, "ms": _best_ms(fn, reps)}
                  for kind, fn in (("fwd", forward), ("fwd+bwd", both))]
    decode = []
    for tk in progress(KV_LENS, desc="torch decode"):
        q = torch.randn(BATCH, HEADS, 1, HEAD_DIM)
        k, v = (torch.randn(BATCH, HEADS // 4, tk, HEAD_DIM) for _ in range(2))
        mask = torch.zeros(BATCH, 1, 1, tk, dtype=torch.bool)
        mask[..., : 3 * tk // 4] = True

        def step(q: Any = q, k: Any = k, v: Any = v, mask: Any = mask) -> None:
            with torch.no_grad():
                sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

        decode.append({"backend": TORCH, "kv_len": tk, "ms": _best_ms(step, reps)})
    return {"run": stamp(), "dense": dense, "decode": decode}


def _series(rows: list[dict[str, Any]], x: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        out.setdefault(row["backend"], []).append((row[x], row["ms"]))
    return {name: sorted(points) for name, points in out.items()}


def report(paths: Sequence[str], folder: str | None) -> str:
    """Markdown tables (ms, and PyTorch's time over each backend's), and the plots."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    dense = [r for run in runs for r in run["dense"]]
    decode = [r for run in runs for r in run["decode"]]
    lines = []
    for kind in ("fwd", "fwd+bwd"):
        series = _series([r for r in dense if r["kind"] == kind], "seq")
        lines += _table(f"dense {kind}, q/k/v [1, S, {HEADS}, {HEAD_DIM}] float32 causal: ms",
                        "S", series, SEQS)
    lines += _table(f"decode step, q [{BATCH}, 1, {HEADS}, {HEAD_DIM}], K and V [{BATCH}, Tk, "
                    f"{HEADS // 4}, {HEAD_DIM}] float32: ms", "Tk", _series(decode, "kv_len"),
                    KV_LENS)
    if folder:
        _plot(dense, decode, runs[0]["run"], Path(folder))
    return "\n".join(lines)


def _table(title: str, x: str, series: dict[str, list[tuple[int, float]]],
           xs: Sequence[int]) -> list[str]:
    names = [n for n in series if n != TORCH] + ([TORCH] if TORCH in series else [])
    ours_names = [n for n in names if n not in (TORCH, "jnp.sum")]
    lines = [f"\n{title}\n", f"| {x} | " + " | ".join(names) + " | torch / fastest of ours |",
             "|---|" + "---|" * (len(names) + 1)]
    for value in xs:
        ms = {n: dict(series[n]).get(value) for n in names}
        fastest = min((ms[n] for n in ours_names if ms[n] is not None), default=None)
        ratio = (f"{ms[TORCH] / fastest:.2f}x" if fastest and ms.get(TORCH) else "-")
        cells = [f"{ms[n]:.3g}" if ms[n] is not None else "-" for n in names]
        lines.append(f"| {value} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def _plot(dense: list[dict[str, Any]], decode: list[dict[str, Any]], run: dict[str, str],
          folder: Path) -> None:
    fig, panels = axes(2, f"Dense attention, q/k/v [1, S, {HEADS}, {HEAD_DIM}] float32, "
                       "causal: best of the timed runs", run)
    for ax, kind in zip(panels, ("fwd", "fwd+bwd"), strict=True):
        for name, points in _series([r for r in dense if r["kind"] == kind], "seq").items():
            ax.plot(*zip(*points, strict=True), marker="o", label=name, **_style(name))
        log_lengths(ax, SEQS, "sequence length S")
        ax.set_yscale("log")
        ax.set_ylabel("ms (lower is better)")
        ax.set_title("forward" if kind == "fwd" else "forward and gradient", fontsize=9)
        ax.legend(fontsize=8)
    save(fig, folder / "dense_time_vs_length.png")
    fig, (ax,) = axes(1, f"Decode step, q [{BATCH}, 1, {HEADS}, {HEAD_DIM}], K and V "
                      f"[{BATCH}, Tk, {HEADS // 4}, {HEAD_DIM}] float32", run, width=7)
    for name, points in _series(decode, "kv_len").items():
        label = "jnp.sum over K and V (reading them)" if name == "jnp.sum" else name
        ax.plot(*zip(*points, strict=True), marker="o", label=label, **_style(name))
    log_lengths(ax, KV_LENS, "cache length Tk")
    ax.set_yscale("log")
    ax.set_ylabel("ms (lower is better)")
    ax.legend(fontsize=8)
    save(fig, folder / "decode_time_vs_context.png")


def _style(name: str) -> dict[str, Any]:
    """PyTorch black and dashed, the bandwidth floor grey and dotted."""
    return {TORCH: {"color": "black", "linestyle": "--"},
            "jnp.sum": {"color": "grey", "linestyle": ":"}}.get(name, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("ours", "torch"))
    parser.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON")
    parser.add_argument("--plot", default=None, metavar="FOLDER",
                        help="with --report: also draw the figures as PNGs into FOLDER")
    args = parser.parse_args()
    if args.report:
        print(report(args.report, args.plot))
        return
    if args.runtime is None:
        parser.error("expected --runtime ours or torch (a run), or --report JSON ... (a report)")
    result = ours(args.backends, args.reps) if args.runtime == "ours" else torch_rows(args.reps)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
