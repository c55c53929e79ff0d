"""Run the conformance suite on native_cpu with another build of its library.

    python sanitizers/run_suite.py LIBRARY [check arguments...]

LIBRARY is a sanitizer build (sanitizers/run.sh builds it); the process must
start with the sanitizer's runtime preloaded (LD_PRELOAD), as Python itself is
not instrumented. Exits with the suite's status; a sanitizer report aborts the
process (non-zero) at the first error.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: run_suite.py LIBRARY [attn-backends check arguments...]")
    library = Path(argv[0]).resolve()
    from attn_backend_native_cpu import _library

    _library.library_path = lambda: library
    reason = _library.load_error()
    if reason is not None:
        raise SystemExit(f"run_suite.py: the library at {library} did not load: {reason}")
    print(f"native_cpu: suite against {library} ({_library.kernel_isa()} kernels)", flush=True)
    from attn_backends_cli.main import main as cli

    # --capture=sys: pytest captures Python's streams only, so a sanitizer's
    # report (written to file descriptor 2 just before it aborts) is seen.
    return cli(["check", "native_cpu", *argv[1:], "--", "--capture=sys"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
