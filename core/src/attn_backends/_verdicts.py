"""Probe verdicts on disk: one JSON file per verdict key under ``<cache>/probes``.

Each record holds the full key it was made under (versions, code digests,
options, the canonical probe call), the outcome with its numbers, and when
it was made; a record whose key differs from the one asked for is ignored.
Writes are atomic (write then rename), so processes sharing the cache never
read half a record.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from ._environment import cache_dir


def digest(key: dict[str, Any]) -> str:
    """The file name stem of ``key``'s record."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def folder() -> Path:
    return cache_dir() / "probes"


def read(key: dict[str, Any]) -> dict[str, Any] | None:
    """The record stored for ``key``, None when there is none.

    Raises OSError or ValueError when the file exists but cannot be read or
    parsed (the caller warns and probes again).
    """
    path = folder() / f"{digest(key)}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    for field in ("passed", "reasons", "seconds"):
        if field not in data:
            raise ValueError(f"record {path} has no {field!r}")
    return data


def write(key: dict[str, Any], record: dict[str, Any]) -> None:
    """Store ``record`` (with ``key`` and the time added); raises OSError if it cannot."""
    path = folder() / f"{digest(key)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {
        "key": key,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **record,
    }
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(stamped, indent=2))
    tmp.replace(path)


def records() -> list[dict[str, Any]]:
    """Every record on disk, with its ``path``; an unreadable one is
    ``{"path": ..., "unreadable": reason}``."""
    out: list[dict[str, Any]] = []
    base = folder()
    for path in sorted(base.glob("*.json")) if base.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            out.append({**data, "path": str(path)} if isinstance(data, dict) else
                       {"path": str(path), "unreadable": "not a JSON object"})
        except (OSError, ValueError) as exc:
            out.append({"path": str(path), "unreadable": f"{type(exc).__name__}: {exc}"})
    return out


def clear(backend: str | None = None, *, quarantined_only: bool = False) -> int:
    """Delete the records of ``backend`` (all backends when None); returns how many.

    ``quarantined_only`` keeps passed verdicts. Unreadable records are
    removed whatever the backend, since nothing can use them.
    """
    removed = 0
    for record in records():
        key = record.get("key") if isinstance(record.get("key"), dict) else {}
        unreadable = "unreadable" in record
        if not unreadable:
            if backend is not None and key.get("backend") != backend:
                continue
            if quarantined_only and record.get("passed"):
                continue
        try:
            Path(record["path"]).unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
