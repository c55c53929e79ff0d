"""Turning ``device=`` into a platform name, and what JAX can see here."""

from __future__ import annotations

import functools
from typing import Any

from ._capabilities import PLATFORMS

_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


@functools.cache
def visible_platforms() -> tuple[str, ...]:
    """Platforms (of cpu, gpu, tpu) that JAX has devices for on this machine."""
    import jax

    seen = []
    for platform in sorted(PLATFORMS):
        try:
            if jax.devices(platform):
                seen.append(platform)
        except RuntimeError:
            # jax.devices raises RuntimeError for a platform with no backend:
            # that is the answer "not visible", not an error to report.
            continue
    return tuple(seen)


def resolve(device: Any) -> tuple[str, bool]:
    """``device`` (None, "cpu"/"gpu"/"tpu"/"cuda", or a jax.Device) -> (platform, present).

    ``present`` says whether JAX can run on that platform here; a platform that
    is not present still selects (by manifest alone) for ``jax.export``.
    """
    import jax

    if device is None:
        platform = _ALIASES.get(jax.default_backend(), jax.default_backend())
        return platform, True
    if isinstance(device, jax.Device):
        platform = _ALIASES.get(device.platform, device.platform)
        return platform, True
    if isinstance(device, str):
        platform = _ALIASES.get(device.lower(), device.lower())
        if platform in PLATFORMS:
            return platform, platform in visible_platforms()
    raise ValueError(
        f"device: expected None, one of {sorted(PLATFORMS)} or a jax.Device, got {device!r}"
    )
