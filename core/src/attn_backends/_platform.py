"""Turning ``device=`` into a platform name, and what JAX can see here."""

from __future__ import annotations

import functools
from typing import Any

from ._capabilities import PLATFORMS

#: Platform names as JAX spells them -> the contract's names (cpu, gpu, tpu).
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
#: The contract's platform names -> the lowering platforms JAX names them by
#: (``jax.export(platforms=...)``, ``jax.lax.platform_dependent``).
LOWERING_NAMES = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def platform_name(name: str) -> str:
    """The contract's name for a platform JAX calls ``name``: "cuda" and "rocm"
    are "gpu"; "cpu", "gpu" and "tpu" are themselves (case-insensitive)."""
    name = name.lower()
    return _ALIASES.get(name, name)


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
        return platform_name(jax.default_backend()), True
    if isinstance(device, jax.Device):
        return platform_name(device.platform), True
    if isinstance(device, str):
        platform = platform_name(device)
        if platform in PLATFORMS:
            return platform, platform in visible_platforms()
    raise ValueError(
        f"device: expected None, one of {sorted(PLATFORMS)} or a jax.Device, got {device!r}"
    )


def resolve_all(device: Any) -> tuple[tuple[str, bool], ...]:
    """:func:`resolve` for ``device`` or for each entry of a list or tuple of them
    (a program exported for several platforms), duplicates dropped."""
    if not isinstance(device, (list, tuple)):
        return (resolve(device),)
    if not device:
        raise ValueError("device: an empty list names no platform; pass None for JAX's default")
    resolved = dict(resolve(d) for d in device)
    return tuple(resolved.items())
