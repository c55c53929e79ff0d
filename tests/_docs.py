"""The Python code of the documentation's pages, as the site shows it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A plain page's ```python block, or a guide's ```{code-cell} ipython3 (myst-nb
# executes those when the site is built).
FENCE = re.compile(r"^```(?:python|\{code-cell\} ipython3)\n(.*?)^```", re.S | re.M)


def code_blocks(page: str) -> list[str]:
    """The Python blocks of ``page`` (a path from the repository root), in order."""
    return FENCE.findall((ROOT / page).read_text())


def code_block(page: str, first_line: str) -> str:
    """The one Python block of ``page`` whose first line is ``first_line``."""
    found = [b for b in code_blocks(page) if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"{page}: expected one block starting {first_line!r}, got {len(found)}"
    return found[0]
