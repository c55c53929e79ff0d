"""The site's build (docs/conf.py, as `make docs` runs it) fails on a broken
cross-reference and on a guide's code cell that raises, and builds a page
that has neither, its cell's output on the page. `make test` builds the whole
site (`make docs`); these small builds show that its checks bite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CONF = Path(__file__).resolve().parents[1] / "docs"
NOTEBOOK = "---\nfile_format: mystnb\nkernelspec:\n  name: python3\n---\n\n"


def _build(tmp_path: Path, page: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading\n")
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-c", str(CONF), "-b",
         "html", str(tmp_path), str(tmp_path / "_build")],
        capture_output=True, text=True, timeout=300)


def test_a_page_with_good_links_and_cells_builds(tmp_path: Path) -> None:
    page = (NOTEBOOK + "# Index\n\n[a page](other.md), [a heading](other.md#a-heading)\n\n"
            "```{toctree}\nother\n```\n\n```{code-cell} ipython3\nprint(6 * 7)\n```\n")
    done = _build(tmp_path, page)
    assert done.returncode == 0, done.stderr[-3000:]
    html = (tmp_path / "_build" / "docs" / "index.html").read_text()
    assert "42" in html


@pytest.mark.parametrize("link", ["missing.md", "other.md#no-such-heading", "#nowhere"])
def test_a_broken_cross_reference_fails_the_build(tmp_path: Path, link: str) -> None:
    done = _build(tmp_path, f"# Index\n\nSee [there]({link}).\n\n```{{toctree}}\nother\n```\n")
    assert done.returncode != 0
    assert "[myst.xref_missing]" in done.stderr, done.stderr[-3000:]


def test_a_cell_that_raises_fails_the_build(tmp_path: Path) -> None:
    page = (NOTEBOOK + "# Index\n\n```{toctree}\nother\n```\n\n"
            "```{code-cell} ipython3\nraise RuntimeError('an example that raises')\n```\n")
    done = _build(tmp_path, page)
    assert done.returncode != 0
    # the warning shows the cell and its error, and names the page
    assert "an example that raises" in done.stderr, done.stderr[-3000:]
    assert "Executing notebook failed" in done.stderr
    assert "docs/index.md: WARNING" in done.stderr and "[mystnb.exec]" in done.stderr
