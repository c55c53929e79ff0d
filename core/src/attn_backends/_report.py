"""What `attn-backends list`, `probe` and `doctor` report, as plain data."""

from __future__ import annotations

import os
import platform as host
import sys
from typing import Any

from . import _certificates, _probe
from ._backend import Backend
from ._contract import AttentionCall, bind
from ._environment import cache_dir, device_kind, versions
from ._platform import resolve, visible_platforms

_SAMPLE_HEAD_DIMS = (64, 128, 32, 256, 16, 8)


def _head_dim(backend: Backend) -> int:
    dims = backend.capabilities.head_dims
    for d in _SAMPLE_HEAD_DIMS:
        if not dims.reasons(d, "head_dim"):
            return d
    return min(dims.allowed) if dims.allowed else dims.multiple_of


def sample_call(backend: Backend, dtype: str, features: frozenset[str]) -> AttentionCall:
    """A representative call (B=2, T=128) using ``features`` in ``dtype``."""
    import jax
    import jax.numpy as jnp

    sds = jax.ShapeDtypeStruct
    b, t, d = 2, 128, _head_dim(backend)
    hkv, hq = 2, 4 if "gqa" in features else 2
    kw: dict[str, Any] = {
        "causal": "causal" in features,
        "window": (32, 0) if "window" in features else None,
        "softcap": 30.0 if "softcap" in features else None,
        "return_lse": "return_lse" in features,
    }
    if "segment_ids" in features:
        kw["segment_ids"] = (sds((b, t), jnp.int32), sds((b, t), jnp.int32))
    if "lengths" in features:
        kw["kv_lengths"] = sds((b,), jnp.int32)
    if "mask" in features:
        kw["mask"] = sds((b, 1, t, t), jnp.bool_)
    if "bias" in features:
        kw["bias"] = sds((1, hq, t, t), jnp.dtype(dtype))
    q = sds((b, t, hq, d), jnp.dtype(dtype))
    kv = sds((b, t, hkv, d), jnp.dtype(dtype))
    return bind(q, kv, kv, **kw)[0]


def probe_plan(backend: Backend) -> list[AttentionCall]:
    """Calls `attn-backends probe` checks: each dtype with no feature, causal, and all claimed."""
    claimed = backend.capabilities.features
    sets = [frozenset(), frozenset({"causal"}) & claimed, claimed]
    unique = list(dict.fromkeys(sets))
    return [sample_call(backend, dtype, fs) for dtype in sorted(backend.capabilities.dtypes) for fs in unique]


def probe_summary(name: str) -> str:
    """``"3 ok, 1 quarantined"`` for verdicts on disk for this jax, or ``"-"``."""
    ok = bad = 0
    jax_version = versions()["jax"]
    for record in _probe.cached_verdicts():
        key = record.get("key", {})
        if key.get("backend") == name and key.get("jax") == jax_version:
            ok, bad = (ok + 1, bad) if record.get("passed") else (ok, bad + 1)
    if not ok and not bad:
        return "-"
    return f"{ok} ok" + (f", {bad} quarantined" if bad else "")


def certificate_summary(backend: Backend, platform: str) -> str:
    cert = _certificates.find(backend.name, backend.version, platform)
    if cert is None:
        return "no"
    cases = cert.get("cases", {})
    verdict = "yes" if _certificates.is_full_pass(cert) else f"FAILED ({cert.get('mode')} run)"
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
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ATTN_BACKENDS_")},
        "backends": [
            {
                "backend": name,
                "distribution": origins[name].distribution,
                "version": backend.version,
                "certificate": certificate_summary(backend, default_platform),
                "probes": probe_summary(name),
            }
            for name, backend in sorted(backends.items())
        ],
        "load_problems": [str(p) for p in registry.problems],
        "probe_cache_entries": len(_probe.cached_verdicts()),
    }
