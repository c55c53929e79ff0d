"""Cost of the registry machinery (issue: probing and selection).

Measures, on the local CPU:
1. ``import attn_backends`` plus discovery of the installed plugins, beyond
   ``import jax``, in fresh processes; and that no kernel module was imported;
2. a warm ``registry.get(device="cpu")``;
3. the first ``get`` and selection in a fresh process whose probe verdict is
   already on disk (what a restarted server pays before its first call
   compiles), beyond ``import jax``, and the core modules that loads;
4. selection for a new call signature when the probe verdict is cached;
5. per-step cost under ``jax.jit``: a jitted step through the registry versus
   the same backend's ``attend`` jitted directly (same compiled program, so
   ~1.00: the lowered module also holds core's platform dispatch, a case on
   a constant platform index that XLA folds away).

Usage: .venv/bin/python benchmarks/bench_registry.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

from attn_backends_contracts.hlo import compiled_instructions

IMPORT_SNIPPET = (
    r"""
import json, sys, time
import jax
t0 = time.perf_counter()
import attn_backends
backends = attn_backends.registry.backends
t1 = time.perf_counter()
plugin_modules = sorted(m for m in sys.modules if m.startswith("attn_backend_") and "." in m)
"""
    'print(json.dumps({"seconds": t1 - t0, "backends": sorted(backends), '
    '"plugin_modules": plugin_modules}))\n'
)


def import_and_discovery(repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_SNIPPET], check=True, capture_output=True, text=True
        ).stdout
        runs.append(json.loads(out))
    times = [r["seconds"] for r in runs]
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "backends": runs[0]["backends"],
        "plugin_modules_imported": runs[0]["plugin_modules"],
    }


FIRST_SELECTION_SNIPPET = r"""
import json, sys, time
import jax, jax.numpy as jnp
sds = jax.ShapeDtypeStruct
q, kv = sds((1, 256, 8, 64), jnp.float32), sds((1, 256, 2, 64), jnp.float32)
t0 = time.perf_counter()
import attn_backends
att = attn_backends.registry.get(device="cpu")
from attn_backends import bind
chosen = att.backend_for(bind(q, kv, kv, causal=True)[0]).name
t1 = time.perf_counter()
core = [m for m in sys.modules if m.split(".")[0] == "attn_backends"]
print(json.dumps({"seconds": t1 - t0, "chosen": chosen, "core_modules": len(core)}))
"""


def first_selection(repeat: int) -> dict:
    """Fresh processes sharing one cache folder: the first probes and stores the
    verdict (not timed), the others find it on disk."""
    run = [sys.executable, "-c", FIRST_SELECTION_SNIPPET]
    subprocess.run(run, check=True, capture_output=True)
    runs = [json.loads(subprocess.run(run, check=True, capture_output=True, text=True).stdout)
            for _ in range(repeat)]
    times = [r["seconds"] for r in runs]
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "chosen": runs[0]["chosen"], "core_modules": runs[0]["core_modules"]}


def warm_get(number: int = 20000) -> float:
    import attn_backends

    attn_backends.registry.get(device="cpu")
    return (
        1e6
        * min(
            timeit.repeat(lambda: attn_backends.registry.get(device="cpu"), number=number, repeat=5)
        )
        / number
    )


def new_signature_selection(count: int = 200) -> dict:
    import attn_backends
    import jax
    import jax.numpy as jnp
    from attn_backends import bind

    sds = jax.ShapeDtypeStruct
    kv = sds((1, 512, 2, 64), jnp.float32)
    calls = [
        bind(sds((1, t, 8, 64), jnp.float32), kv, kv, causal=True)[0] for t in range(2, 2 + count)
    ]
    # Warm the probe verdicts: the calls fall into a few probe keys (dtype,
    # features, head dims, length classes); a first pass probes each once.
    warm = attn_backends.registry.get(device="cpu")
    for call in calls:
        warm.backend_for(call)
    # A fresh Attention: every signature is new to it, every verdict cached.
    att = attn_backends.registry.get(device="cpu")
    start = time.perf_counter()
    chosen = {att.backend_for(call).name for call in calls}
    per_call = (time.perf_counter() - start) / count
    return {"ms_per_new_signature": 1e3 * per_call, "chosen": sorted(chosen)}


def jit_step_overhead(steps: int = 50) -> dict:
    import attn_backends
    import jax
    from attn_backends import bind

    att = attn_backends.registry.get(device="cpu")
    q = jax.random.normal(jax.random.key(0), (1, 1024, 8, 64))
    kv = jax.random.normal(jax.random.key(1), (1, 1024, 2, 64))
    call, ops = bind(q, kv, kv, causal=True)
    backend = att.backend_for(call)
    via_registry = jax.jit(lambda q, k, v: att(q, k, v, causal=True))
    direct = jax.jit(lambda q, k, v: backend.attend(call, q, k, v, ops))

    def timed(fn) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            out = fn(q, kv, kv)
        out.block_until_ready()
        return (time.perf_counter() - start) / steps

    via_registry(q, kv, kv).block_until_ready()
    direct(q, kv, kv).block_until_ready()
    # Interleaved rounds, best of each, so background load hits both alike.
    rounds = [(timed(via_registry), timed(direct)) for _ in range(7)]
    t_reg, t_direct = min(r for r, _ in rounds), min(d for _, d in rounds)
    lowered = via_registry.lower(q, kv, kv), direct.lower(q, kv, kv)
    programs = [compiled_instructions(one.compile()) for one in lowered]
    same_program = programs[0] == programs[1]
    return {
        "backend": backend.name,
        "registry_ms": 1e3 * t_reg,
        "direct_ms": 1e3 * t_direct,
        "ratio": t_reg / t_direct,
        "same_program": same_program,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=7, help="fresh processes for the import timing"
    )
    args = parser.parse_args()
    import os

    os.environ.setdefault("ATTN_BACKENDS_CACHE_DIR", tempfile.mkdtemp(prefix="attn-bench-"))
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "import_and_discovery": import_and_discovery(args.repeat),
        "warm_get_us": warm_get(),
        "first_selection": first_selection(args.repeat),
        "new_signature": new_signature_selection(),
        "jit_step": jit_step_overhead(),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
