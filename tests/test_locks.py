"""The environments install what their locks say, and tools/lock_diff.py reads locks right.

A lock (requirements/*.txt, written by ``uv pip compile``) pins every third-party
package; make installs it as it is. This process's environment must hold each
pinned package at exactly its version: the lock make installed (``REPO_LOCK``,
set by the Makefile: the canary's own lock under ``make test-newest``), else the
lock of this Python's line.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lock_diff", ROOT / "tools" / "lock_diff.py")
lock_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock_diff)


def _this_lines_lock() -> Path:
    given = os.environ.get("REPO_LOCK")
    if given:
        return Path(given)
    return ROOT / "requirements" / ("main.txt" if sys.version_info >= (3, 12) else "compat.txt")


def test_every_pinned_package_is_installed_at_its_version() -> None:
    pins = lock_diff.pins(_this_lines_lock())
    assert "jax" in pins and "jaxlib" in pins and "numpy" in pins
    wrong = {name: (version, _installed(name)) for name, version in pins.items()
             if _installed(name) != version}
    assert not wrong, f"installed versions differ from {_this_lines_lock()}: {wrong}"


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_each_lock_pins_exact_versions_of_jax_and_the_repo_installs_none_of_its_own() -> None:
    for lock in ("main.txt", "compat.txt", "peer.txt"):
        text = (ROOT / "requirements" / lock).read_text()
        pins = lock_diff.pins(ROOT / "requirements" / lock)
        assert pins and not any(name.startswith("attn-backend") for name in pins), lock
        for line in text.splitlines():
            if line and not line.startswith((" ", "#")):
                assert "==" in line and not line.startswith("-e"), f"{lock}: {line!r}"


def _lock(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_lock_diff_says_in_one_line_what_moved(tmp_path: Path, capsys) -> None:
    old = _lock(tmp_path, "old.txt", "jax==0.12.0.1\n    # via x\nJax_Lib==0.12.0\nsix==1.0\n")
    new = _lock(tmp_path, "new.txt",
                "jax==0.12.1\njax-lib==0.12.0\nflax==0.12.12 ; python_version >= '3.12'\n")
    assert lock_diff.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (f"versions moved ({old} -> {new}): jax 0.12.0.1 -> 0.12.1; "
                   "new: flax 0.12.12; gone: six 1.0")
    assert lock_diff.main([str(old), str(old)]) == 0
    assert capsys.readouterr().out.strip() == f"no version moved ({old} -> {old})"


def test_lock_diff_refuses_versions_outside_the_declared_ranges(tmp_path: Path, capsys) -> None:
    old = _lock(tmp_path, "old.txt", "jax==0.12.1\n")
    newest = _lock(tmp_path, "newest.txt", "jax==0.13.0\n")
    in_range = _lock(tmp_path, "in-range.txt", "jax==0.12.1\n")
    assert lock_diff.main([str(old), str(newest), "--in-range", str(in_range)]) == 1
    err = capsys.readouterr().err
    assert "jax 0.13.0 (the declared ranges give 0.12.1)" in err and "widen" in err
    assert lock_diff.main([str(old), str(newest), "--in-range", str(newest)]) == 0


@pytest.mark.parametrize("lock", ["main.txt", "compat.txt"])
def test_the_jax_lines_are_the_ones_the_docs_name(lock: str) -> None:
    pins = lock_diff.pins(ROOT / "requirements" / lock)
    line = pins["jax"].split(".")[:2]
    assert line == (["0", "12"] if lock == "main.txt" else ["0", "10"]), pins["jax"]
    assert pins["jaxlib"] == pins["jax"] or pins["jaxlib"].startswith(pins["jax"])
