"""Ring attention across two processes on localhost joined by jax.distributed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_two_process_worker.py")
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ring_attention_across_two_processes(tmp_path):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ATTN_BACKENDS_CACHE_DIR": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(i), str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} failed:\n{text[-3000:]}"
        assert f"RING-OK {i}" in text, text[-3000:]
