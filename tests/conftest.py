"""Fixtures for the repo's own tests (helpers live in _support.py)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import attn_backends as ab
import jax
import pytest
from _support import Plugin
from attn_backends import Backend


def _compile_once_per_process() -> None:
    """JAX's persistent compilation cache, in a folder of this process's own.

    Tests build a fresh Registry, probe cache and jitted closure per test, so the
    same programs (a backend's probe at one signature above all) compile again
    and again in one process; with the cache each compiles once and loads after.
    The folder is this process's alone (no two processes ever write one entry,
    a write JAX does not make atomic) and is deleted at its exit. Subprocesses
    the tests start compile as before.
    """
    folder = tempfile.mkdtemp(prefix="attn-tests-xla-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_compile_once_per_process()


@pytest.fixture
def fake_registry() -> Callable[..., ab.Registry]:
    """Build a Registry of in-process fake backends, no entry points.

    Probes are off unless asked for (``probe="auto"``): these tests are about
    selection's machinery, and many fakes compute nothing (zeros).
    """

    def build(*backends: Backend, **kwargs: Any) -> ab.Registry:
        kwargs.setdefault("probe", None)
        return ab.Registry(plugins=[Plugin(*backends)], autoload=False, **kwargs)

    return build



@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Probe verdicts and certificates go to a per-test folder, never ~/.cache."""
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "attn-cache"))
    return tmp_path / "attn-cache"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files marked ``slow(seconds=N)`` first, the longest first, then the rest
    in collection order.

    make test's two workers take one file at a time (``--dist loadfile
    --no-loadscope-reorder``): with the long files started first, no long file
    starts last while the other worker has nothing left to run. ``seconds`` is
    the file's time under make test (its --durations, summed), kept roughly.
    """

    def seconds(item: pytest.Item) -> float:
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else float(slow.kwargs.get("seconds", 1))

    items.sort(key=seconds, reverse=True)
