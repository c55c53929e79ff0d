"""What this process runs on: ``device=`` as a platform name, the platforms JAX
sees, the software and hardware a verdict (probe, certificate) is valid for, and
the ``ATTN_BACKENDS_*`` settings."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from .capabilities import PLATFORMS

T = TypeVar("T")

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


def expected(accepts: str, got: str) -> str:
    """How a setting's error says what it takes and what it was given:
    ``expected ACCEPTS, got 'GOT'`` (after the setting's name)."""
    return f"expected {accepts}, got {got!r}"


def env_setting(name: str, parse: Callable[[str], T], *, accepts: str, default: T) -> T:
    """The environment variable ``name``, read by ``parse``; ``default`` when it
    is unset or blank.

    Every ``ATTN_BACKENDS_*`` variable is read here. ``parse`` is given the
    value without surrounding whitespace and raises ValueError for one it does
    not take; the ValueError raised then names the variable, what it read and
    ``accepts`` (what it takes): ``NAME: expected ACCEPTS, got 'VALUE'``.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return parse(raw.strip())
    except ValueError:
        raise ValueError(f"{name}: {expected(accepts, raw)}") from None


_FLAG_WORDS = {"0": False, "false": False, "no": False, "off": False,
               "1": True, "true": True, "yes": True, "on": True}


def _flag(text: str) -> bool:
    try:
        return _FLAG_WORDS[text.lower()]
    except KeyError:
        raise ValueError(text) from None


def env_flag(var: str) -> bool:
    """The on/off environment variable ``var``: unset, 0/false/no/off (off) or
    1/true/yes/on (on), any case; anything else raises ValueError naming it."""
    return env_setting(var, _flag, accepts="1/0 (or true/false, yes/no, on/off)", default=False)


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def versions() -> dict[str, str | None]:
    """attn-backends, jax, jaxlib and libtpu versions (None when not installed)."""
    return {
        "attn_backends": _installed("attn-backends"),
        "jax": _installed("jax"),
        "jaxlib": _installed("jaxlib"),
        "libtpu": _installed("libtpu") or _installed("libtpu-nightly"),
    }


def device_kind(platform: str) -> str | None:
    """``jax.devices(platform)[0].device_kind``, or None when the platform is absent."""

    if platform not in visible_platforms():
        return None
    import jax

    return str(jax.devices(platform)[0].device_kind)


def _absolute_path(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise ValueError(text)  # relative to the working directory: each process its own cache
    return path


def cache_dir() -> Path:
    """``$ATTN_BACKENDS_CACHE_DIR`` (an absolute path; ``~`` is expanded), else
    ``$XDG_CACHE_HOME/attn-backends`` or ``~/.cache/attn-backends``."""
    explicit = env_setting("ATTN_BACKENDS_CACHE_DIR", _absolute_path,
                           accepts="an absolute directory path (~ allowed)", default=None)
    if explicit is not None:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn-backends"
