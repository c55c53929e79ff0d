"""What `attn-backends list`, `probe` and `doctor` report, as plain data."""

from __future__ import annotations

import os
import platform as host
import sys
from typing import Any

from attn_backends.contract.backend import Backend
from attn_backends.contract.environment import (
    cache_dir,
    device_kind,
    resolve,
    versions,
    visible_platforms,
)
from attn_backends.probe import certificates as _certificates
from attn_backends.probe import verdicts as _verdicts
from attn_backends.probe.digests import code_digests


def probe_summary(backend: Backend) -> str:
    """``"3 ok, 1 quarantined"`` for the verdicts on disk that the code installed now
    earned (this jax, this backend and core), or ``"-"``; older ones no longer
    count (``attn-backends probe --clear`` removes them)."""
    ok = bad = 0
    jax_version = versions()["jax"]
    digests = code_digests(backend)
    for record in _verdicts.records():
        key = record.get("key", {})
        if (key.get("backend") == backend.name and key.get("jax") == jax_version
                and key.get("backend_digest") == digests["backend"]
                and key.get("core_digest") == digests["core"]):
            ok, bad = (ok + 1, bad) if record.get("passed") else (ok, bad + 1)
    if not ok and not bad:
        return "-"
    return f"{ok} ok" + (f", {bad} quarantined" if bad else "")


def certificate_summary(backend: Backend, platform: str) -> str:
    """``"yes: 182/183 cases"``, ``"passed (quick run; ...)"``, ``"FAILED (full run)"``,
    ``"no"`` or ``"VOID: <why>"``."""
    found = _certificates.status(backend, platform)
    cert = found.certificate
    if cert is None:
        return "no"
    if found.void:
        return "VOID: " + "; ".join(found.void)
    cases = cert.get("cases", {})
    if _certificates.is_full_pass(cert):
        verdict = "yes"
    elif cert.get("passed"):
        run = "quick" if cert.get("mode") == "quick" else "partial"
        verdict = f"passed ({run} run; only a full run certifies)"
    else:
        verdict = f"FAILED ({cert.get('mode')} run)"
    return f"{verdict}: {cases.get('passed', '?')}/{cases.get('run', '?')} cases"


def doctor(registry: Any) -> dict[str, Any]:
    """Everything a bug report needs about this environment."""
    default_platform, _ = resolve(None)
    backends = registry.backends
    origins = registry.origins
    return {
        "python": sys.version.split()[0],
        "os": f"{host.system()} {host.release()} {host.machine()}",
        **versions(),
        "default_platform": default_platform,
        "visible_platforms": {p: device_kind(p) for p in visible_platforms()},
        "cache_dir": str(cache_dir()),
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith("ATTN_BACKENDS_")},
        "backends": [
            {
                "backend": name,
                "distribution": origins[name].distribution,
                "version": backend.version,
                "certificate": certificate_summary(backend, default_platform),
                "probes": probe_summary(backend),
            }
            for name, backend in sorted(backends.items())
        ],
        "load_problems": [str(p) for p in registry.problems],
        "probes": "on: each backend is compared with core's float64 oracle once per "
                  "verdict key before it serves (attn-backends probe --quarantined lists failures)"
                  if registry.probe is not None else "off (Registry(probe=None))",
        "probe_cache_entries": len(_verdicts.records()),
    }
