"""Every distribution's metadata is complete, and pip's jax range is the manifest's.

Read from the tracked pyproject.toml files (no build): a wheel carries what
they say. A backend whose pip requirement allows a jax its manifest rejects
installs cleanly and is then skipped at discovery; one whose requirement is
narrower refuses installs the backend would serve.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]


def _projects() -> list[tuple[Path, dict[str, Any]]]:
    out = subprocess.run(["git", "ls-files", "*pyproject.toml"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    # tests/ holds fixture distributions that are never published.
    found = [(REPO / p, tomllib.loads((REPO / p).read_text())) for p in out
             if not p.startswith("tests/")]
    return [(path, data["project"]) for path, data in found if "project" in data]


PROJECTS = _projects()


@pytest.mark.parametrize(("path", "project"), PROJECTS, ids=[p["name"] for _, p in PROJECTS])
def test_metadata_is_complete(path: Path, project: dict[str, Any]) -> None:
    for key in ("description", "readme", "license", "requires-python", "classifiers"):
        assert project.get(key), f"{path.relative_to(REPO)}: [project] {key} is missing"
    readme = path.parent / project["readme"]
    lines = [line for line in readme.read_text().splitlines() if line.strip()]
    assert len(lines) >= 10, f"{readme.relative_to(REPO)}: a {len(lines)}-line long description"
    assert "Typing :: Typed" in project["classifiers"]


BACKENDS = [(path, project) for path, project in PROJECTS
            if "attn_backends" in project.get("entry-points", {})]
#: Backends whose library is an extra pinning an older jax than the adapter's own
#: requirement (ejkernel pins jax~=0.10.0): the adapter installs on every line, so
#: the refusal is explained there, and its manifest declares the extra's range.
NARROWED_BY_AN_EXTRA = {"attn-backend-ejkernel": ("ejkernel", ">=0.10,<0.11")}


@pytest.mark.parametrize(("path", "project"), BACKENDS, ids=[p["name"] for _, p in BACKENDS])
def test_pip_jax_range_is_the_manifests(path: Path, project: dict[str, Any]) -> None:
    jax = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "jax"]
    assert len(jax) == 1, f"{project['name']}: expected one jax requirement, got {jax}"
    sys.path.insert(0, str(path.parent / "src"))
    try:
        for name, target in project["entry-points"]["attn_backends"].items():
            # "module" or "module:object" (one plugin object per entry point).
            module, _, attribute = target.partition(":")
            plugin = importlib.import_module(module)
            plugin = getattr(plugin, attribute) if attribute else plugin
            backends = plugin.attn_backends_register()
            for backend in backends:
                manifest = SpecifierSet(backend.capabilities.jax_versions)
                if project["name"] in NARROWED_BY_AN_EXTRA:
                    extra, declared = NARROWED_BY_AN_EXTRA[project["name"]]
                    assert extra in project.get("optional-dependencies", {}), project["name"]
                    assert manifest == SpecifierSet(declared), manifest
                    continue
                assert jax[0].specifier == manifest, (
                    f"{project['name']} ({name}): pip requires jax{jax[0].specifier}, the "
                    f"manifest declares {backend.capabilities.jax_versions!r}; make them equal"
                )
    finally:
        sys.path.remove(str(path.parent / "src"))
