"""What agreement across processes costs: per new call signature, and per warm step.

Run from the repo root (starts its own processes on 127.0.0.1, gloo, 2 cpu
devices each):

    .venv/bin/python benchmarks/bench_multihost.py                 # 1, 2 and 4 processes
    .venv/bin/python benchmarks/bench_multihost.py --processes 1,2 --signatures 5

Each process uses the default registry with probes on and a fresh cache of its
own. After one warm-up signature (its probes run and are cached: every later
signature shares their shape class), it selects ``--signatures`` new ones
(``Attention.backend_for`` of calls whose key length differs: q [2, 64, 4, 64],
kv [2, 64 + 16 i, 4, 64], float32, causal) and times each. With one process
that is plain selection; with several it adds the agreement (every backend
judged, one exchange of offers through JAX's coordination service). Then it
runs ``--steps`` calls of a jitted step on a signature already known and
counts the coordination-service calls the registry makes during them.
Printed: the first signature's time (its probes: every candidate is probed
with several processes, only until one passes with one), the median selection
time per new signature for each process count (the slowest process's median,
since all wait for the last offer), its ratio to one process, and the
coordination-service calls per new signature and per warm step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _worker(process: int, count: int, port: int, signatures: int, steps: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if count > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=count, process_id=process)
    import attn_backends as ab
    import numpy as np

    calls = {"n": 0}
    if count > 1:
        hosts = ab.registry.features.plugin("hosts")
        from attn_backends.authoring import jax_api

        client = jax_api.distributed_client()

        class Counting:
            """The coordination client, counting every call agreement makes."""

            def __getattr__(self, name: str) -> Any:
                calls["n"] += 1
                return getattr(client, name)

        hosts._store = Counting()
    attention = ab.registry.get(fallback="silent")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 64, 4, 64)).astype(np.float32)

    def call(tk: int) -> Any:
        kv = rng.standard_normal((2, tk, 4, 64)).astype(np.float32)
        return ab.bind(q, kv, kv, causal=True)[0], kv

    start = time.perf_counter()
    attention.backend_for(call(48)[0])  # warm-up: probes for the shape class
    first_s = time.perf_counter() - start
    selecting = calls["n"]
    times = []
    for i in range(signatures):
        signature, _ = call(64 + 16 * i)
        start = time.perf_counter()
        attention.backend_for(signature)
        times.append(time.perf_counter() - start)
    selecting = (calls["n"] - selecting) / signatures
    _, kv = call(64)
    step = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))
    step(q, kv, kv).block_until_ready()
    before = calls["n"]
    for _ in range(steps):
        step(q, kv, kv).block_until_ready()
    print("BENCH " + json.dumps({"process": process, "median_s": statistics.median(times),
                                 "first_s": first_s, "selection_calls": selecting,
                                 "warm_calls": calls["n"] - before, "steps": steps}),
          flush=True)
    if count > 1:
        from attn_backends.authoring import jax_api

        jax_api.distributed_client().wait_at_barrier("bench-done", 60_000)
    os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(count: int, signatures: int, steps: int) -> dict[str, Any]:
    """One run of ``count`` processes: the slowest median and the warm calls."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), str(count), str(port),
             str(signatures), str(steps)],
            env={**os.environ, "JAX_PLATFORMS": "cpu", "ATTN_BACKENDS_CACHE_DIR":
                 os.path.join(tmp, f"cache{i}")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(count)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    rows = []
    for text in outputs:
        lines = [line for line in text.splitlines() if line.startswith("BENCH ")]
        if not lines:
            raise SystemExit(f"a worker printed no result:\n{text[-3000:]}")
        rows.append(json.loads(lines[-1][len("BENCH "):]))
    return {"processes": count, "median_ms": 1e3 * max(r["median_s"] for r in rows),
            "first_s": max(r["first_s"] for r in rows),
            "selection_calls": max(r["selection_calls"] for r in rows),
            "warm_calls_per_step": max(r["warm_calls"] for r in rows) / steps}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        _worker(*(int(a) for a in sys.argv[2:7]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--signatures", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus; "
          f"python {platform.python_version()}")
    results = [measure(int(n), args.signatures, args.steps) for n in args.processes.split(",")]
    base = next((r["median_ms"] for r in results if r["processes"] == 1), None)
    print("| processes | first signature (probes) | selection per new signature (median, "
          "slowest process) | ratio to 1 process | coordination calls per new signature "
          "| per warm step |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['median_ms'] / base:.2f}x" if base else "-"
        print(f"| {r['processes']} | {r['first_s']:.2f} s | {r['median_ms']:.2f} ms | {ratio} | "
              f"{r['selection_calls']:g} | {r['warm_calls_per_step']:g} |")


if __name__ == "__main__":
    main()
