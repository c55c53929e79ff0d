"""The API reference (docs/api.md) documents every public name: each name in
``attn_backends.__all__``, ``attn_backends.authoring.__all__`` and
``attn_backends_flax.__all__`` is the target of an autodoc directive there,
each directive names the object the public name is, and the judging modules
(the oracle, tolerances, certificates) are documented whole (their ``__all__``)."""

from __future__ import annotations

import importlib
import re

import attn_backends
import attn_backends.authoring
import attn_backends_flax
import pytest
from _docs import ROOT

DIRECTIVE = re.compile(r"^\.\. auto(class|function|data|exception|module):: (\S+)$", re.M)


def _documented() -> dict[str, object]:
    """Each directive's target, by its last name, resolved to the object."""
    out = {}
    for kind, target in DIRECTIVE.findall((ROOT / "docs" / "api.md").read_text()):
        module, _, name = target.rpartition(".")
        out[name] = (importlib.import_module(target) if kind == "module"
                     else getattr(importlib.import_module(module), name))
    return out


MODULES = [attn_backends, attn_backends.authoring, attn_backends_flax]
WHOLE = ["attn_backends.oracle", "attn_backends.tolerances", "attn_backends.certificates"]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_public_name_is_in_the_reference(module) -> None:
    documented = _documented()
    missing = [n for n in module.__all__ if n not in documented]
    assert not missing, f"{module.__name__}: not in docs/api.md: {missing}"
    wrong = [n for n in module.__all__ if documented[n] is not getattr(module, n)]
    assert not wrong, f"{module.__name__}: docs/api.md documents another object as {wrong}"


@pytest.mark.parametrize("name", WHOLE)
def test_the_judging_modules_are_documented_whole(name) -> None:
    module = importlib.import_module(name)
    assert module.__all__ and _documented().get(name.rpartition(".")[2]) is module
