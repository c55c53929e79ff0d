"""Core's tests run without any plugin: entry points are not loaded here, so every
backend a test sees is an in-process fake (``_support``) or a distribution the test
itself writes and loads with ``autoload=True``."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_installed_plugins(monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_NO_AUTOLOAD", "1")
    yield
    # A test here that reached the process-wide registry discovered nothing; later
    # tests of the same worker (outside tests/core) must discover the plugins.
    from attn_backends.choose.registry import registry

    registry.reload()
