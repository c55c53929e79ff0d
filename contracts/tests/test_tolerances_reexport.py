"""The suite judges with core's comparison and table: its module re-exports them."""

from __future__ import annotations

from attn_backends import tolerances as core_tolerances
from attn_backends_contracts import tolerances as suite_tolerances


def test_contracts_reexports_the_same_objects() -> None:
    for name in core_tolerances.__all__:
        assert getattr(suite_tolerances, name) is getattr(core_tolerances, name)
