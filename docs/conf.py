"""Sphinx configuration of the attn-backends site (``make docs``).

The source directory is the repository root, so the Markdown a reader meets on
GitHub (docs/, BENCHMARKS.md, each plugin's README) is the site's pages, and
every relative link between them is a cross-reference Sphinx checks. The
build runs with warnings as errors: a link to a page or heading that does not
exist fails it, and so does a code cell that raises (myst-nb executes each
guide's cells in a fresh kernel per page and warns with the traceback).
"""

from __future__ import annotations

import os
from pathlib import Path

project = "attn-backends"
author = "the attn-backends developers"
copyright = "2026, the attn-backends developers"

extensions = [
    "myst_nb",              # MyST Markdown, and pages with code cells executed
    "sphinx.ext.autodoc",   # the API reference, from the docstrings
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

root_doc = "docs/index"
# Only these files are pages; the rest of the repository (tests, .venv, caches)
# is never read.
include_patterns = [
    "docs/**.md",
    "BENCHMARKS.md",
    "plugins/*/README.md",
    "contracts/README.md",
    "examples/gemma3/README.md",
    "examples/serving/README.md",
]
exclude_patterns = ["docs/_build/**", ".venv*/**", ".newest/**", ".attn-cache/**",
                    ".certificates/**", "dist/**", "**/build/**"]

# Headings h1-h3 get anchors, so [text](page.md#a-heading) is a checked link.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
# A relative link to a file that is not a page (a test, a source file) stays a
# link to that path; a link to a missing page or anchor is a warning (an error).
myst_url_schemes = ["http", "https", "mailto"]

# Code cells: executed on every build, in a fresh kernel per page, in a cache
# folder of their own (probes write verdicts there, never to ~/.cache). A cell
# that raises is a warning carrying its traceback (an error under -W, and
# --keep-going reports every failing page), not a crash of Sphinx that hides it.
nb_execution_mode = "force"
nb_execution_raise_on_error = False
nb_execution_show_tb = True
nb_execution_timeout = 300
nb_merge_streams = True
# Beside the built site, so `make docs` (which removes docs/_build) starts it empty.
os.environ.setdefault("ATTN_BACKENDS_CACHE_DIR",
                      str(Path(__file__).resolve().parent / "_build" / "attn-cache"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = False

html_theme = "furo"
html_title = "attn-backends"
html_static_path: list[str] = []
