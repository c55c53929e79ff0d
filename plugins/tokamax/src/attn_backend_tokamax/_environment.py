"""Whether the tokamax this adapter was certified with is installed, read from the
installed distribution's metadata: nothing here imports tokamax (its import
takes seconds and pulls in pydantic, qwix and flax)."""

from __future__ import annotations

import functools
import warnings
from importlib import metadata
from typing import Any

#: The tokamax releases the conformance suite certified these backends with, and
#: the jax line each was certified on (pinned in pyproject.toml by Python
#: version: 0.0.17 needs Python >= 3.12 and jax >= 0.11.1). The adapter builds
#: tokamax's implementation objects itself (the public ``dot_product_attention``
#: picks Mosaic by the default device), which ties it to the releases certified.
TOKAMAX_CERTIFIED = {"0.0.12": "jax 0.10", "0.0.17": "jax 0.12"}
HOW_TO_INSTALL = ("pip install attn-backend-tokamax (tokamax 0.0.17 on Python >= 3.12, "
                  "0.0.12 on 3.11)")


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
    if installed not in TOKAMAX_CERTIFIED:
        certified = ", ".join(f"{v} (on {line})" for v, line in TOKAMAX_CERTIFIED.items())
        return [
            f"tokamax {installed} is installed, but these backends were certified with "
            f"tokamax {certified} only: {HOW_TO_INSTALL}, or certify {installed} "
            "with `attn-backends check tokamax_xla` and add it to TOKAMAX_CERTIFIED"
        ]
    return []


def import_tokamax() -> Any:
    """``import tokamax``, with absl's flags marked parsed first (their defaults), and
    tokamax's own deprecation warnings at import left out (below).

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
    with warnings.catch_warnings():
        # tokamax 0.0.17's own modules name pl.GridSpec in an annotation
        # (tokamax/_src/pallas/block.py), which jax 0.12.1 deprecates: a
        # DeprecationWarning at tokamax's import, attributed to tokamax, that a
        # user's -W error (and the suite's filterwarnings) would turn into an
        # import failure. Only warnings from tokamax's modules are ignored; the
        # README's findings name it.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"tokamax\.")
        import tokamax

    return tokamax
