"""Tiny version parsing and range checks (no dependency on `packaging`)."""

from __future__ import annotations

import re

_RELEASE = re.compile(r"^\s*(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.10.2rc1"`` -> ``(0, 10, 2)``; trailing zeros dropped so 0.10 == 0.10.0."""
    match = _RELEASE.match(version)
    if not match:
        raise ValueError(f"version={version!r} is not a release number like '0.10.2'")
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def validate_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` is like ``">=0.10,<0.13"``."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        if not _CLAUSE.match(clause):
            raise ValueError(
                f"version range clause {clause!r} in {spec!r} is not of the form "
                "'>=0.10' (operators: >=, <=, ==, !=, >, <)"
            )


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every comma-separated clause of ``spec``."""
    have = release_tuple(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = _CLAUSE.match(clause)
        if not match:
            raise ValueError(f"bad version range {spec!r}")
        op, bound = match.group(1), release_tuple(match.group(2))
        ok = {
            ">=": have >= bound,
            "<=": have <= bound,
            ">": have > bound,
            "<": have < bound,
            "==": have == bound,
            "!=": have != bound,
        }[op]
        if not ok:
            return False
    return True
