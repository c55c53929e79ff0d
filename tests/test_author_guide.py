"""The guide "Write a backend" (docs/guides/write-backend.md), followed literally, yields a
certified backend.

The files are taken from the guide's fenced blocks marked ``# file: PATH``,
built and installed with pip into a temporary target, then discovered by a
fresh ``attn-backends list``, used through the registry, and certified by
``attn-backends check`` (the full conformance suite): an example that fails
the suite it tells authors to run is a bug in the guide.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "write-backend.md"
BLOCK = re.compile(r"```\w*\n# file: (?P<path>\S+)\n(?P<body>.*?)```", re.S)


def test_the_guides_backend_builds_installs_is_listed_and_certified(tmp_path):
    blocks = BLOCK.findall(GUIDE.read_text())
    assert {p for p, _ in blocks} == {
        "attn-backend-mine/pyproject.toml", "attn-backend-mine/attn_backend_mine.py"
    }
    for rel, body in blocks:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(tmp_path / "attn-backend-mine")],
        check=True, capture_output=True, text=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "ATTN_BACKENDS_CACHE_DIR": str(tmp_path)}
    env.pop("ATTN_BACKENDS_ONLY", None)
    cli = [
        sys.executable, "-c", "from attn_backends_cli.main import main; raise SystemExit(main())"
    ]
    listed = subprocess.run([*cli, "list", "--json"], env=env, check=True,
                            capture_output=True, text=True)
    records = {r["backend"]: r for r in json.loads(listed.stdout)["backends"]}
    assert records["mine"]["distribution"] == "attn-backend-mine"
    assert records["mine"]["capabilities"]["dtypes"] == ["float32"]

    script = (
        "import jax.numpy as jnp, numpy as np, attn_backends as ab\n"
        "from attn_backends_contracts._oracle import attention as oracle\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v = (rng.normal(size=(1, 5, 2, 8)).astype('float32') for _ in range(3))\n"
        "att = ab.registry.get(device='cpu', backend='mine')\n"
        "out = att(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))\n"
        "print(float(np.abs(np.asarray(out) - oracle(q, k, v)[0]).max()))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                         capture_output=True, text=True)
    assert float(run.stdout) < 1e-5

    cert = tmp_path / "cert.json"
    check = subprocess.run([*cli, "check", "mine", "--json", str(cert)], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
    certificate = json.loads(cert.read_text())
    assert check.returncode == 0, check.stdout[-3000:]
    assert certificate["passed"] and certificate["mode"] == "full", certificate["failures"]
    assert certificate["families"].get("unclaimed"), certificate["families"]
