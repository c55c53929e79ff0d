"""Conformance certificates: stored by `attn-backends check`, shown by `list`.

A certificate is valid for one environment key: backend name and version,
jax/jaxlib/libtpu versions, platform and device kind.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ._environment import cache_dir, device_kind, versions
from ._errors import AttnBackendsWarning, warn

KEY_FIELDS = ("backend", "backend_version", "jax", "jaxlib", "libtpu", "platform", "device_kind")


def environment_key(backend: str, backend_version: str, platform: str) -> dict[str, Any]:
    """The fields a certificate must match to count for this environment."""
    found = versions()
    return {
        "backend": backend,
        "backend_version": backend_version,
        "jax": found["jax"],
        "jaxlib": found["jaxlib"],
        "libtpu": found["libtpu"],
        "platform": platform,
        "device_kind": device_kind(platform),
    }


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "certificates" / f"{key['backend']}-{digest}.json"


def store(certificate: dict[str, Any]) -> Path | None:
    """Save ``certificate`` (which holds the KEY_FIELDS) in the cache; warn if it cannot."""
    key = {f: certificate.get(f) for f in KEY_FIELDS}
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(certificate, indent=2, sort_keys=True))
    except OSError as exc:
        warn(
            f"could not store the certificate for {key['backend']!r} in {path.parent}: {exc}",
            AttnBackendsWarning,
        )
        return None
    return path


def is_full_pass(certificate: dict[str, Any]) -> bool:
    """A passed run of the whole suite (not ``--attn-quick`` or ``--attn-only``)."""
    return (
        certificate.get("passed") is True
        and certificate.get("mode") == "full"
        and not certificate.get("only_families")
    )


def find(backend: str, backend_version: str, platform: str) -> dict[str, Any] | None:
    """The stored certificate matching this environment, or None."""
    key = environment_key(backend, backend_version, platform)
    path = _path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(data.get(f) != key[f] for f in KEY_FIELDS):
        return None
    return data
