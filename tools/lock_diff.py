"""Which versions moved between two lock files (uv pip compile output), in one line.

    python tools/lock_diff.py OLD NEW [--in-range LOCK]

Prints "versions moved (OLD -> NEW): jax 0.12.1 -> 0.13.0, ...; new: ...; gone: ..."
or "no version moved (OLD -> NEW)". With ``--in-range LOCK`` (the same inputs
resolved within the repository's own declared ranges, today), exits 1 naming
every package NEW pins otherwise: ``make lock`` moves the pins only to what the
canary passed on and the declared ranges give.
Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line (names normalised)."""
    found = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            found[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    return found


def moved(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The changes from ``old`` to ``new``, as readable phrases, sorted by name."""
    changed = [f"{n} {old[n]} -> {new[n]}" for n in sorted(old.keys() & new.keys())
               if old[n] != new[n]]
    added = [f"{n} {new[n]}" for n in sorted(new.keys() - old.keys())]
    gone = [f"{n} {old[n]}" for n in sorted(old.keys() - new.keys())]
    parts = [", ".join(changed)] if changed else []
    parts += [f"new: {', '.join(added)}"] if added else []
    parts += [f"gone: {', '.join(gone)}"] if gone else []
    return parts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--in-range", type=Path, default=None)
    args = parser.parse_args(argv)
    new = pins(args.new)
    parts = moved(pins(args.old), new)
    where = f"({args.old} -> {args.new})"
    print(f"versions moved {where}: {'; '.join(parts)}" if parts else f"no version moved {where}")
    if args.in_range is not None:
        allowed = pins(args.in_range)
        names = sorted(new.keys() | allowed.keys())
        differ = [f"{n} {new.get(n, 'none')} (the declared ranges give {allowed.get(n, 'none')})"
                  for n in names if allowed.get(n) != new.get(n)]
        if differ:
            print(f"not what the declared ranges resolve to today: {', '.join(differ)}. "
                  "Either the repository's ranges hold it back (widen requirements/*.in and "
                  "the distributions' pyproject.toml, and the manifests' jax_versions, on "
                  "purpose first), or a release came out since the canary ran (run make "
                  "test-newest again)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
