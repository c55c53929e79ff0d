"""Probe verdicts on disk: one JSON record per verdict key under ``<cache>/probes``.

Each record holds the full key it was made under (versions, code digests,
options, the canonical probe call), the outcome with its numbers, and when
it was made; a record whose key differs from the one asked for is ignored.
Files are kept by :mod:`.store`: writes are atomic, so processes sharing the
cache never read half a record, and an unreadable record is reported once and
ignored (the backend is probed again).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

from .store import Store


def digest(key: dict[str, Any]) -> str:
    """The file name stem of ``key``'s record."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _problem(record: dict[str, Any]) -> str | None:
    """Why ``record`` is not a verdict (None: it is one)."""
    for field in ("key", "passed", "reasons", "seconds"):
        if field not in record:
            return f"it has no {field!r}"
    reasons, seconds = record["reasons"], record["seconds"]
    if not isinstance(record["key"], dict):
        return "its 'key' is not a JSON object"
    if not isinstance(record["passed"], bool):
        return "its 'passed' is not true or false"
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        return "its 'reasons' is not a list of strings"
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "its 'seconds' is not a number"
    if record["passed"] == bool(reasons):
        return "its 'passed' contradicts its 'reasons'"
    return None


STORE = Store("probes", what="probe cache", holds="probe verdicts",
              ignored="the backend is probed again", check=_problem)


def folder() -> Path:
    return STORE.folder()


def read(key: dict[str, Any]) -> dict[str, Any] | None:
    """The record stored for ``key``; None when there is none, when the one
    found was made under another key, or when it is unreadable (reported once
    with a warning naming the file; the caller probes again)."""
    data = STORE.read(digest(key))
    # Compared as JSON holds it: a tuple in the key (a window) is a list on disk.
    if data is None or data.get("key") != json.loads(json.dumps(key)):
        return None
    return data


def write(key: dict[str, Any], record: dict[str, Any]) -> Path | None:
    """Store ``record`` with ``key`` and the time added; its path, or None when the
    cache is not writable (kept in memory for this process, with one warning)."""
    stamped = {
        "key": key,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **record,
    }
    return STORE.write(digest(key), stamped)


def records() -> list[dict[str, Any]]:
    """Every record, with its ``path``; an unreadable one is
    ``{"path": ..., "unreadable": reason}``."""
    return [{**e.record, "path": str(e.path)} if e.record is not None else
            {"path": str(e.path), "unreadable": e.problem} for e in STORE.entries()]


def clear(backend: str | None = None, *, quarantined_only: bool = False) -> int:
    """Delete the records of ``backend`` (all backends when None); returns how many.

    ``quarantined_only`` keeps passed verdicts. Unreadable records are
    removed whatever the backend, since nothing can use them.
    """
    removed = 0
    for entry in STORE.entries():
        if entry.record is not None:
            if backend is not None and entry.record["key"].get("backend") != backend:
                continue
            if quarantined_only and entry.record["passed"]:
                continue
        removed += STORE.remove(entry.path)
    return removed
