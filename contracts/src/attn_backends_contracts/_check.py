"""``run_check``: the conformance suite in-process, behind ``attn-backends check``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class _Handle:
    """Plugin object handed to pytest.main: carries a Backend in, the suite out."""

    def __init__(self, backend: Any):
        self.attn_backend_provided = backend
        self.suite: Any = None


def run_check(
    backend: Any,
    json_path: str | None = None,
    extra_pytest_args: Sequence[str] = (),
) -> int:
    """Run the suite on ``backend`` and return pytest's exit code (0 = conformant).

    ``backend`` is an installed backend's name, or a ``Backend`` instance (an
    in-process backend: its certificate is written to ``json_path`` but not
    stored, since ``attn-backends list`` shows installed backends only). The
    certificate of an installed backend is also stored with
    ``attn_backends.certificates.store``. ``extra_pytest_args`` go to pytest
    (e.g. ``["--attn-quick", "-x", "-k", "causal"]``).
    """
    import pytest

    by_name = isinstance(backend, str)
    handle = _Handle(None if by_name else backend)
    args = [
        "--pyargs", "attn_backends_contracts", "-p", "attn_backends_contracts",
        # The caller (the CLI) imported this package before pytest could mark
        # it for assertion rewriting; the suite's own test modules still are.
        "-W", "ignore:Module already imported so cannot be rewritten"
        ":pytest.PytestAssertRewriteWarning",
    ]
    if by_name:
        args.append(f"--attn-backend={backend}")
    args += list(extra_pytest_args)
    code = int(pytest.main(args, plugins=[handle]))
    certificate = getattr(handle.suite, "certificate", None)
    if certificate is not None:
        if json_path:
            Path(json_path).write_text(json.dumps(certificate, indent=2, sort_keys=True))
        if by_name:
            from attn_backends import certificates

            certificates.store(certificate)
    return code
