"""The "Many chips" examples (docs/MANY_CHIPS.md, README.md) run as written, in fresh processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _many_chips_example(path: Path) -> str:
    text = path.read_text()
    if path.name == "README.md":
        text = text.split("## Many chips", 1)[1].split("\n## ", 1)[0]
    else:  # "Many hosts" shows a launch on a pod, which needs its hosts to run
        text = text.split("\n## Many hosts", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, f"{path.name}: the 'Many chips' part has one runnable example"
    return blocks[0]


@pytest.mark.parametrize("doc", ["docs/MANY_CHIPS.md", "README.md"])
def test_many_chips_example_runs(tmp_path, doc):
    script = tmp_path / "many_chips_example.py"
    script.write_text(_many_chips_example(ROOT / doc))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ATTN_BACKENDS_CACHE_DIR": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    env.pop("ATTN_BACKENDS_PALLAS_INTERPRET", None)
    # Every warning an error.
    done = subprocess.run([sys.executable, "-W", "error", str(script)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sequence over sp (4): ring" in done.stdout
