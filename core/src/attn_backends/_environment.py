"""The software and hardware environment a verdict (probe, certificate) is valid for."""

from __future__ import annotations

import functools
import os
from importlib import metadata
from pathlib import Path


def env_flag(var: str) -> bool:
    """The on/off environment variable ``var``: unset, 0/false/no/off (off) or
    1/true/yes/on (on), any case; anything else raises ValueError naming it."""
    value = os.environ.get(var, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{var}: expected 1/0 (or true/false, yes/no, on/off), got {value!r}")


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
    from ._platform import visible_platforms

    if platform not in visible_platforms():
        return None
    import jax

    return str(jax.devices(platform)[0].device_kind)


def cache_dir() -> Path:
    """``$ATTN_BACKENDS_CACHE_DIR``, else ``$XDG_CACHE_HOME/attn-backends`` or ``~/.cache/attn-backends``."""
    explicit = os.environ.get("ATTN_BACKENDS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn-backends"
