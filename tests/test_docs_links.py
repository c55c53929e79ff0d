"""Docs point only inside the repository, and package pages have no links that break.

A distribution's README is its long description on a package index, where a
relative link (``../../core``) leads nowhere; the repository's other Markdown
files may link relatively, but only to paths that exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
#: Phrases that cite design notes kept outside this repository.
OUTSIDE = ("steering", "DESIGN §")


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [REPO / line for line in out.splitlines()]


def _package_readmes() -> set[Path]:
    """The README named by each distribution's pyproject.toml."""
    readmes = set()
    for pyproject in _tracked("*pyproject.toml"):
        match = re.search(r'^readme\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        if match:
            readmes.add(pyproject.parent / match.group(1))
    return readmes


def test_package_readmes_have_no_relative_links() -> None:
    readmes = _package_readmes()
    assert REPO / "core" / "README.md" in readmes, sorted(map(str, readmes))
    bad = [f"{p.relative_to(REPO)}: ({m['target']})" for p in sorted(readmes)
           for m in LINK.finditer(p.read_text()) if "://" not in m["target"]]
    assert not bad, "relative links break on a package index page:\n" + "\n".join(bad)


def test_markdown_links_resolve_inside_the_repo() -> None:
    bad = []
    for path in _tracked("*.md"):
        for m in LINK.finditer(path.read_text()):
            target = m["target"].split("#")[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            if REPO not in resolved.parents or not resolved.exists():
                bad.append(f"{path.relative_to(REPO)}: ({m['target']})")
    assert not bad, "links that leave the repository or lead nowhere:\n" + "\n".join(bad)


def test_no_file_cites_design_notes_outside_the_repo() -> None:
    bad = [f"{p.relative_to(REPO)}: {phrase!r}"
           for pattern in ("*.md", "*.py", "*.toml")
           for p in _tracked(pattern) if p != Path(__file__).resolve()
           for phrase in OUTSIDE if phrase in p.read_text()]
    assert not bad, "cite docs/DESIGN.md instead:\n" + "\n".join(bad)
