"""Start COUNT worker processes on 127.0.0.1, joined by jax.distributed, and
collect each one's RESULT line (tests/multihost/_worker.py); the command line in
COUNT processes; and what the tests ask of the results (one choice, one error)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_worker.py")
#: JAX's compilation caches of the processes this (pytest) process starts, one
#: folder per process rank: the processes of one run compile the same programs
#: at the same time (so no sharing there), and the next run's process of the
#: same rank, never running beside it, loads them. Deleted at exit.
_COMPILE_CACHES = Path(tempfile.mkdtemp(prefix="attn-multihost-xla-cache-"))
atexit.register(shutil.rmtree, _COMPILE_CACHES, ignore_errors=True)


def _compile_cache(rank: int) -> dict[str, str]:
    """The environment that gives process ``rank`` its compilation cache."""
    return {"JAX_COMPILATION_CACHE_DIR": str(_COMPILE_CACHES / f"rank{rank}"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(tmp: Path, count: int, scenario: str, *, env: Sequence[Mapping[str, str]] = (),
        shared_cache: bool = False, timeout_s: float = 240,
        ) -> tuple[list[dict[str, Any]], float]:
    """Each process's RESULT (in process order) and the run's wall time. ``env``
    adds variables per process; each process has a fresh cache folder of its own
    unless ``shared_cache`` (one folder, as on a shared file system). A process
    still running after ``timeout_s`` is killed and the test fails with its output.

    In the ``die`` and ``hang`` scenarios the last process never reports: it is
    not waited for (a hanging one is killed once the others are done), and each
    other process reports a RESULT, or ``{"aborted": output}`` when JAX's
    distributed service ended it for its dead peer."""
    port = _free_port()
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs = []
    for i in range(count):
        cache = tmp / ("cache" if shared_cache else f"cache{i}")
        extra = dict(env[i]) if i < len(env) else {}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(count), str(port), scenario],
            env={**base, **_compile_cache(i), "ATTN_BACKENDS_CACHE_DIR": str(cache), **extra},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    outputs = []
    silent = count - 1 if scenario in ("die", "hang") else None
    try:
        for proc in procs[:silent]:
            left = max(1.0, timeout_s - (time.monotonic() - start))
            try:
                outputs.append(proc.communicate(timeout=left)[0])
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{scenario}: a process still ran after {timeout_s} s "
                                     "(a hang)") from None
    finally:
        _reap(procs)
    seconds = time.monotonic() - start
    results = []
    for i, text in enumerate(outputs):
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if not lines and silent is not None and procs[i].returncode != 0:
            results.append({"process": i, "aborted": text})
            continue
        assert lines, f"process {i} printed no RESULT (exit {procs[i].returncode}):\n{text[-3000:]}"
        results.append({**json.loads(lines[-1][len("RESULT "):]), "output": text})
    return results, seconds


def run_cli(tmp: Path, count: int, args: Sequence[str], timeout_s: float = 180,
            ) -> list[tuple[int, str]]:
    """``attn-backends --distributed 127.0.0.1:PORT,COUNT,I ARGS`` in ``count``
    processes at once (a fresh cache each): each one's exit status and output."""
    port = _free_port()
    command = Path(sys.executable).with_name("attn-backends")
    procs = [subprocess.Popen(
        [str(command), "--distributed", f"127.0.0.1:{port},{count},{i}", *args],
        env={**os.environ, **_compile_cache(i), "JAX_PLATFORMS": "cpu",
             "ATTN_BACKENDS_CACHE_DIR": str(tmp / f"c{i}")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(count)]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        _reap(procs)
    return [(p.returncode, text) for p, text in zip(procs, outputs, strict=True)]


def _reap(procs: Sequence[subprocess.Popen]) -> None:
    """Kill what still runs (a hang, or the silent process) and close every pipe."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def single_process_choice(without: Sequence[str] = ()) -> str:
    """What one process alone chooses for the workers' plain call; with ``without``,
    what it chooses when those backends are not installed (the next in its order)."""
    import attn_backends as ab
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 32, 4, 16)).astype(np.float32) for _ in range(3))
    registry = ab.Registry(disable=without) if without else ab.registry
    return registry.get().explain(q, k, v, causal=True).chosen


def choices(results: list[dict]) -> dict[str, str]:
    """Each call's backend, the same on every process; fails naming each process's
    choices otherwise."""
    for r in results:
        assert r.get("error") is None, f"process {r['process']}: {r['error']}\n{r.get('trace')}"
    assert all(r["chosen"] == results[0]["chosen"] for r in results), (
        "processes chose differently: " + "; ".join(
            f"process {r['process']}: {r['chosen']}" for r in results))
    return results[0]["chosen"]


def one_choice(results: list[dict]) -> str:
    """The one backend every process was served by, for every call; fails naming
    each process's choices otherwise."""
    by_call = choices(results)
    chosen = set(by_call.values())
    assert len(chosen) == 1, f"one backend for every call expected, got {by_call}"
    return chosen.pop()


def one_error(results: list[dict]) -> str:
    """The one AgreementError message every process raised."""
    errors = {tuple(r["error"]) if r.get("error") else None for r in results}
    assert len(errors) == 1 and None not in errors, [r.get("error") for r in results]
    kind, message = errors.pop()
    assert kind == "AgreementError", message
    return message
