"""The reference backend's paged attention against the float64 oracle
(docs/DESIGN.md, "Paged attention"): the shared case set, tests/_paged_support.py's
:class:`PagedCases`.
"""

from __future__ import annotations

from _paged_support import PagedCases


class TestReferencePaged(PagedCases):
    backend = "reference"
