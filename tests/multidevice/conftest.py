"""Eight virtual CPU devices for the sharding and ring tests (their own pytest process).

JAX fixes the device count when its backend starts, so this must run before
anything touches a device: run this folder alone,
``.venv/bin/python -m pytest tests/multidevice``, never inside the main run.
When JAX already started with fewer devices (collected together with other
tests), every test here is skipped with that reason instead of failing.
"""

from __future__ import annotations

import sys

import jax
import pytest

DEVICES = 8

# Only when this folder was asked for: a whole-repo run that collects it by
# mistake must not change the device count under every other test.
if any("multidevice" in arg for arg in sys.argv[1:]):
    try:
        jax.config.update("jax_num_cpu_devices", DEVICES)
        _PROBLEM = None
    except RuntimeError as exc:  # the backend already started in this process
        _PROBLEM = str(exc).splitlines()[0]
else:
    _PROBLEM = "tests/multidevice was not named on the command line"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _PROBLEM is None and len(jax.devices()) >= DEVICES:
        return
    why = _PROBLEM or f"JAX sees {len(jax.devices())} devices"
    skip = pytest.mark.skip(
        reason=f"needs {DEVICES} virtual devices set before JAX starts ({why}); "
        "run: python -m pytest tests/multidevice"
    )
    for item in items:
        if "multidevice" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture
def md_registry(monkeypatch: pytest.MonkeyPatch) -> object:
    """The installed backends without probes (each probe would compile per block call),
    with flash_pallas in interpret mode so it serves cpu."""
    import attn_backends as ab

    monkeypatch.setenv("ATTN_BACKENDS_PALLAS_INTERPRET", "1")
    return ab.Registry(probe=None)
