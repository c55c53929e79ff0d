"""Comparing compiled programs: does the registry add nothing to a backend's own?"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["compiled_instructions"]


def compiled_instructions(compiled: Any) -> str:
    """The HLO text of ``compiled`` (a ``jax.stages.Compiled``) without source
    locations and the module's name: two programs that compute the same thing
    the same way give the same text, wherever they were traced from."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)
    return re.sub(r"HloModule \S+", "HloModule", text)
