"""Whether the tokamax this adapter was certified with is installed, read from the
installed distribution's metadata: nothing here imports tokamax (its import
takes seconds and pulls in pydantic, qwix and flax)."""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

#: The tokamax release the conformance suite certified these backends with
#: (pinned in pyproject.toml). The adapter builds tokamax's implementation
#: objects itself (the public ``dot_product_attention`` picks Mosaic by the
#: default device), which ties it to one release.
TOKAMAX_CERTIFIED = "0.0.12"
HOW_TO_INSTALL = f"pip install tokamax=={TOKAMAX_CERTIFIED} (or pip install attn-backend-tokamax)"


@functools.cache
def tokamax_version() -> str | None:
    """The installed tokamax's version, or None when it is not installed."""
    try:
        return metadata.version("tokamax")
    except metadata.PackageNotFoundError:
        return None


def tokamax_reasons() -> list[str]:
    """Why no tokamax backend can serve here: tokamax missing or another release."""
    installed = tokamax_version()
    if installed is None:
        return [f"tokamax is not installed: {HOW_TO_INSTALL}"]
    if installed != TOKAMAX_CERTIFIED:
        return [
            f"tokamax {installed} is installed, but these backends were certified with "
            f"tokamax {TOKAMAX_CERTIFIED} only: {HOW_TO_INSTALL}, or certify {installed} "
            "with `attn-backends check tokamax_xla` and raise TOKAMAX_CERTIFIED"
        ]
    return []


def import_tokamax() -> Any:
    """``import tokamax``, with absl's flags marked parsed first (their defaults).

    tokamax reads its configuration from absl flags, and the first read parses
    the whole ``sys.argv`` as absl flags (``tokamax/_src/config.py``): under any
    other command line (pytest's, ``attn-backends check --quick``, a training
    script's argparse flags) that raises ``UnrecognizedFlagError`` from inside
    attention. A program that parses its own absl flags (``absl.app.run``) has
    done so before this runs, and keeps them.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax
