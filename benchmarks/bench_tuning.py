"""Measured selection on this machine: does a tuning table pick the fastest backend?

Run from the repo root:

    .venv/bin/python benchmarks/bench_tuning.py                 # tune, then judge in a new process
    .venv/bin/python benchmarks/bench_tuning.py --quick         # two shapes, short rounds
    .venv/bin/python benchmarks/bench_tuning.py --judges 1      # no run-to-run floor

Two processes. The first runs ``attn-backends tune``'s function over the grid
below (forward, and forward+backward, as separate entries) and writes a
table. The second, started afresh, times every candidate again, interleaved
in rounds, and for each shape and pass reports the backend the table makes
selection choose (``registry.get(tuning=table)``, read at trace time) and
the priority order's choice, each as its time over the fastest candidate's
in this second run. The bar: the tuned choice within 1.05x of the fastest on
every shape; the priority order's regret is the peer.

A third process (``--judges 2``, the default) judges again: the same table,
the same grid, timed afresh. Besides its own tuned / fastest, it gives this
machine's floor for any table: the first judge's fastest backend, timed in
the second judge, over the second judge's fastest. A table that picked each
shape's winner perfectly, by one run's clock, cannot do better than that
against another run.

Grid (GQA 8:2, D=64, float32 unless said): causal B=8 S=32, 64, 128; B=4
S=256; B=2 S=512; B=1 S=2048; non-causal B=8 S=128; bfloat16 causal B=8
S=128; decode steps B=8 Tq=1 Tk=1024 with kv_lengths.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

from plotting import progress

GRID = [
    # (label, batch, q_len, kv_len, dtype, causal, kv_lengths)
    ("B=8 S=32 causal", 8, 32, 32, "float32", True, False),
    ("B=8 S=64 causal", 8, 64, 64, "float32", True, False),
    ("B=8 S=128 causal", 8, 128, 128, "float32", True, False),
    ("B=4 S=256 causal", 4, 256, 256, "float32", True, False),
    ("B=2 S=512 causal", 2, 512, 512, "float32", True, False),
    ("B=1 S=2048 causal", 1, 2048, 2048, "float32", True, False),
    ("B=8 S=128 no mask", 8, 128, 128, "float32", False, False),
    ("B=8 S=128 causal bf16", 8, 128, 128, "bfloat16", True, False),
    ("decode B=8 Tk=1024", 8, 1, 1024, "float32", True, True),
]
QUICK = {"B=8 S=32 causal", "decode B=8 Tk=1024"}


def _signatures(quick: bool) -> list[tuple[str, Any]]:
    import attn_backends as ab
    import jax
    import jax.numpy as jnp
    from attn_backends_cli.tune import Signature

    out = []
    for label, b, tq, tk, dtype, causal, lengths in GRID:
        if quick and label not in QUICK:
            continue
        sds = jax.ShapeDtypeStruct
        q = sds((b, tq, 8, 64), jnp.dtype(dtype))
        kv = sds((b, tk, 2, 64), jnp.dtype(dtype))
        kwargs = {"kv_lengths": sds((b,), jnp.int32)} if lengths else {}
        call, _ = ab.contract.call.bind(q, kv, kv, causal=causal, **kwargs)
        for grad in (False, True):
            if grad and tq == 1:
                continue  # decode steps are not differentiated
            out.append((f"{label} {'fwd+bwd' if grad else 'fwd'}", Signature(call, grad)))
    return out


def make_table(path: Path, quick: bool, rounds: int, runs: int) -> None:
    import attn_backends as ab
    from attn_backends.probe.tuning import environment, identity
    from attn_backends_cli.tune import tune

    registry = ab.registry
    table = tune(registry, [s for _, s in _signatures(quick)], "cpu",
                 environment=environment("cpu"), identity=identity(registry.backends),
                 rounds=rounds, runs=runs)
    table.save(path)


def judge(path: Path, quick: bool, rounds: int, runs: int) -> list[dict[str, Any]]:
    """Every candidate timed again here; the tuned and the priority choice against
    the fastest."""
    import attn_backends as ab
    from attn_backends.probe.tuning import identity
    from attn_backends_cli.tune import tune_one

    registry = ab.registry
    tuned = registry.get(device="cpu", tuning=path, fallback="silent")
    rows = []
    for label, signature in progress(_signatures(quick), desc="bench_tuning"):
        entry = tune_one(registry, signature, "cpu", identity=identity(registry.backends),
                         rounds=rounds, runs=runs)
        medians = {n: c["median_s"] for n, c in entry.candidates.items() if "median_s" in c}
        fastest = min(medians, key=medians.__getitem__)
        chosen = tuned.backend_for(signature.call, "cpu", grad=signature.grad).name
        rows.append({
            "shape": label, "fastest": fastest, "fastest_ms": 1e3 * medians[fastest],
            "tuned": chosen, "tuned_vs_fastest": medians[chosen] / medians[fastest],
            "priority": entry.default,
            "priority_vs_fastest": medians[entry.default] / medians[fastest],
            "medians_ms": {n: round(1e3 * m, 4) for n, m in sorted(medians.items())},
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, 3 rounds of 1 run")
    parser.add_argument("--table", default=None, help="keep the table here (default: a temp file)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--judges", type=int, default=2,
                        help="judging processes (>= 2 also prints the run-to-run floor)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--phase", choices=("both", "tune", "judge"), default="both",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.runs = 3, 1
    if args.judges < 1:
        parser.error(f"--judges must be >= 1, got {args.judges}")
    path = Path(args.table or Path(tempfile.mkdtemp()) / "tuning.json")
    if args.phase == "tune":
        make_table(path, args.quick, args.rounds, args.runs)
        return 0
    if args.phase == "judge":
        print(json.dumps(judge(path, args.quick, args.rounds, args.runs)))
        return 0
    common = ["--table", str(path), "--rounds", str(args.rounds), "--runs", str(args.runs)]
    common += ["--quick"] if args.quick else []
    # Each phase in its own process: a judging run shares no warm cache,
    # compiled program or timing state with the run that made the table, nor
    # with another judging run.
    subprocess.run([sys.executable, __file__, "--phase", "tune", *common], check=True)
    judges = []
    for _ in range(args.judges):
        judged = subprocess.run([sys.executable, __file__, "--phase", "judge", *common],
                                check=True, capture_output=True, text=True)
        judges.append(json.loads(judged.stdout.strip().splitlines()[-1]))
    floors = [floor(a, b) for a, b in pairwise(judges)]
    if args.json:
        print(json.dumps({"table": str(path), "judges": judges, "floors": floors}, indent=1))
        return 0
    print(f"table: {path}")
    for i, rows in enumerate(judges, 1):
        print(f"judge {i}")
        _print(rows)
    for i, rows in enumerate(floors, 1):
        print(f"floor: judge {i}'s fastest timed by judge {i + 1}")
        for r in rows:
            print(f"  {r['shape']:<30} {r['first']:<14} {r['second']:<14} {r['ratio']:>5.2f}")
        print(f"  worst: {max(r['ratio'] for r in rows):.2f}x; within 1.05x on "
              f"{sum(r['ratio'] <= 1.05 for r in rows)} of {len(rows)} shapes")
    return 0


def floor(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape: ``first``'s fastest backend timed by ``second``, over ``second``'s fastest."""
    out = []
    for a, b in zip(first, second, strict=True):
        times = b["medians_ms"]
        out.append({"shape": a["shape"], "first": a["fastest"], "second": b["fastest"],
                    "ratio": times[a["fastest"]] / times[b["fastest"]]})
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"  {'shape':<30} {'fastest':<14} {'ms':>8}  {'tuned':<14} {'x':>5}  "
          f"{'priority':<12} {'x':>5}")
    for r in rows:
        print(f"  {r['shape']:<30} {r['fastest']:<14} {r['fastest_ms']:>8.3f}  "
              f"{r['tuned']:<14} {r['tuned_vs_fastest']:>5.2f}  "
              f"{r['priority']:<12} {r['priority_vs_fastest']:>5.2f}")
    worst = max(r["tuned_vs_fastest"] for r in rows)
    regret = max(r["priority_vs_fastest"] for r in rows)
    print(f"  worst tuned / fastest: {worst:.2f}x (bar 1.05x); worst priority / fastest: "
          f"{regret:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
