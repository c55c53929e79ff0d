"""Digests of installed code: what a certificate or a probe verdict was earned by.

A version string does not identify code: an editable install, or a rebuild
under the same version, changes the kernel and keeps the version. So
certificates and verdicts also record a digest of the files of the package
that holds the backend, of core (which runs the probe and dispatches the
call) and of the conformance suite.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from pathlib import Path

from ..contract.backend import Backend

CORE_PACKAGE = "attn_backends"
SUITE_PACKAGE = "attn_backends_contracts"


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(
        p for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )


@functools.cache
def package_digest(module: str) -> str | None:
    """sha256 (24 hex digits) over the files of the top-level package holding ``module``.

    Covers every file under the package folder (sources, data), so editable
    and regular installs are treated alike. None when the module cannot be
    found or has no file (a backend defined in an interactive session).
    Computed once per process.
    """
    top = module.split(".")[0]
    loaded = sys.modules.get(top)
    root: Path | None = None
    if loaded is not None and getattr(loaded, "__path__", None):
        root = Path(list(loaded.__path__)[0])
    elif loaded is not None and getattr(loaded, "__file__", None):
        root = Path(loaded.__file__)
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0])
        elif spec is not None and spec.origin and spec.origin not in ("built-in", "frozen"):
            root = Path(spec.origin)
    if root is None or not root.exists():
        return None
    sha = hashlib.sha256()
    for path in _files(root):
        sha.update(str(path.relative_to(root.parent)).encode())
        sha.update(b"\0")
        sha.update(path.read_bytes())
        sha.update(b"\0")
    return sha.hexdigest()[:24]


def code_digests(backend: Backend) -> dict[str, str | None]:
    """``{"backend", "core", "suite"}`` digests for ``backend`` (suite None if not installed)."""
    return {
        "backend": package_digest(type(backend).__module__),
        "core": package_digest(CORE_PACKAGE),
        "suite": package_digest(SUITE_PACKAGE),
    }
