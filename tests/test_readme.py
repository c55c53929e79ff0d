"""The README is a landing page: short, its first-use example runs as written,
and every topic it lists is a page of the site (docs/conf.py's pages)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from fnmatch import fnmatch

from _docs import ROOT, code_blocks

LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def _site_patterns() -> list[str]:
    """docs/conf.py's ``include_patterns``, read without running the configuration
    (which sets environment variables for the build)."""
    tree = ast.parse((ROOT / "docs" / "conf.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "include_patterns" for t in node.targets)]
    return ast.literal_eval(value)


def test_the_readme_is_at_most_150_lines() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 150, lines


def test_the_first_use_example_runs_as_written(tmp_path) -> None:
    (block,) = code_blocks("README.md")
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-W", "error", "-c", block], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CHOSEN" in done.stdout, done.stdout  # explain names the backend that serves


def test_every_topic_links_to_a_page_of_the_site() -> None:
    text = (ROOT / "README.md").read_text()
    topics = text.split("## Where each topic is", 1)[1]
    targets = [m["target"] for m in LINK.finditer(topics)]
    assert len(targets) >= 17, targets
    patterns = _site_patterns()
    outside = [t for t in targets if not any(fnmatch(t, p) for p in patterns)]
    assert not outside, f"README topics that are no page of the site: {outside}"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing
