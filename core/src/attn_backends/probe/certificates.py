"""Conformance certificates: stored by `attn-backends check`, shown by `list`.

A certificate is found by its environment (backend name and version,
jax/jaxlib/libtpu versions, platform, device kind) and counts only while the
code that earned it is unchanged: it records digests of the backend's
package, of core and of the suite (:mod:`.digests`), and any difference
voids it, with the reason shown by ``attn-backends list``. Certificates are
kept by :mod:`.store`: written atomically, and one that cannot be read is
reported once and counts as no certificate.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.backend import Backend
from ..contract.environment import device_kind, versions
from .digests import code_digests
from .store import Store

KEY_FIELDS = ("backend", "backend_version", "jax", "jaxlib", "libtpu", "platform", "device_kind")


def _problem(certificate: dict[str, Any]) -> str | None:
    """Why ``certificate`` is not one (None: it is one)."""
    missing = [f for f in KEY_FIELDS if f not in certificate]
    if missing:
        return f"it has no {', '.join(map(repr, missing))}"
    if not isinstance(certificate.get("passed"), bool):
        return "its 'passed' is missing or not true or false"
    return None


STORE = Store("certificates", what="certificate cache", holds="certificates",
              ignored="the backend counts as not certified", check=_problem)


def environment_key(backend: Backend, platform: str) -> dict[str, Any]:
    """The fields a certificate is stored under, plus the code digests it must match."""
    found = versions()
    return {
        "backend": backend.name,
        "backend_version": backend.version,
        "jax": found["jax"],
        "jaxlib": found["jaxlib"],
        "libtpu": found["libtpu"],
        "platform": platform,
        "device_kind": device_kind(platform),
        "code_digests": code_digests(backend),
    }


def _slot(certificate: dict[str, Any]) -> str:
    """"full" for a run of the whole suite, "partial" for ``--attn-quick`` or
    ``--attn-only``: a partial run never replaces a full one of the same code."""
    return "full" if certificate.get("mode") == "full" and not certificate.get(
        "only_families") else "partial"


def _name(key: dict[str, Any], slot: str) -> str:
    """One file per environment, code and slot: a run of other code (a failing
    change, say) never replaces the certificate this code earned."""
    fields = {f: key.get(f) for f in KEY_FIELDS}
    fields["code_digests"] = key.get("code_digests")
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return f"{key['backend']}-{digest}-{slot}"


def store(certificate: dict[str, Any]) -> Path | None:
    """Save ``certificate`` (which holds the KEY_FIELDS) in the cache, atomically;
    its path, or None when the cache is not writable (then it is kept in memory
    for this process, with one warning)."""
    return STORE.write(_name(certificate, _slot(certificate)), certificate)


def is_full_pass(certificate: dict[str, Any]) -> bool:
    """A passed run of the whole suite (not ``--attn-quick`` or ``--attn-only``)."""
    return (
        certificate.get("passed") is True
        and certificate.get("mode") == "full"
        and not certificate.get("only_families")
    )


@dataclass(frozen=True)
class CertificateStatus:
    """The stored certificate for a backend here (or None), and whether it counts.

    ``void`` says why a found certificate does not count (empty when it does,
    or when none was found).
    """

    certificate: dict[str, Any] | None
    void: tuple[str, ...] = ()

    @property
    def counts(self) -> bool:
        """A full passing run, earned by the code installed now."""
        return self.certificate is not None and not self.void and is_full_pass(self.certificate)


def _void_reasons(stored: dict[str, Any], now: dict[str, str | None]) -> list[str]:
    earned = stored.get("code_digests")
    if not isinstance(earned, dict):
        return ["it records no code digest (made by an older attn-backends): run check again"]
    reasons = []
    for part, what in (("backend", "the backend's code"), ("core", "attn-backends core"),
                       ("suite", "the conformance suite")):
        if part == "suite" and now.get(part) is None:
            continue  # the suite is not installed here: nothing to compare with
        if earned.get(part) != now.get(part):
            reasons.append(
                f"{what} changed since it was certified "
                f"(digest {earned.get(part)} then, {now.get(part)} now)"
            )
    return reasons


def status(backend: Backend, platform: str) -> CertificateStatus:
    """The certificate stored for ``backend`` in this environment, and whether it counts.

    The one earned by the code installed now (a full run before a partial one);
    else the newest earned by other code, void with the reasons; else none.
    """
    key = environment_key(backend, platform)
    for slot in ("full", "partial"):
        data = STORE.read(_name(key, slot))  # an unreadable file counts as none
        if data is not None and _same_environment(data, key):
            return CertificateStatus(data, tuple(_void_reasons(data, key["code_digests"])))
    others = [entry.record for entry in STORE.entries()
              if entry.record is not None and _same_environment(entry.record, key)]
    if not others:
        return CertificateStatus(None)
    newest = max(others, key=lambda record: str(record.get("date", "")))
    return CertificateStatus(newest, tuple(_void_reasons(newest, key["code_digests"])))


def _same_environment(certificate: dict[str, Any], key: dict[str, Any]) -> bool:
    return all(certificate.get(f) == key[f] for f in KEY_FIELDS)
