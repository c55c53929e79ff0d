"""Core's layers (docs/DESIGN.md, "Core's layers"): the table there places every
module, no import climbs it, no import circle exists anywhere, and the plain call
loads nothing above the choosing layer.

Every import counts: module level, inside a function, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attn_backends
import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = Path(attn_backends.__file__).parent
DESIGN = ROOT / "docs" / "DESIGN.md"
PACKAGES = [CORE, ROOT / "contracts/src/attn_backends_contracts",
            *sorted(ROOT.glob("plugins/*/src/attn_backend_*")),
            *sorted(ROOT.glob("examples/*/src/attn_backend_*"))]
#: The interfaces over core, each a distribution of its own.
INTERFACES = [ROOT / "cli/src/attn_backends_cli", ROOT / "flax_adapter/src/attn_backends_flax"]
#: Most of core's modules ``import attn_backends`` may load (docs/DESIGN.md).
IMPORT_BUDGET = 15


def layer_table(text: str) -> dict[str, int]:
    """``{"contract/": 1, "probe/": 3, ...}`` from the table of "Core's layers"."""
    section = text.split("## 9. Core's layers", 1)[1]
    table: dict[str, int] = {}
    for line in section.splitlines():
        row = re.match(r"\| (\d+) [^|]+\| ([^|]+) \|", line)
        if row:
            for place in re.findall(r"`([^`]+)`", row.group(2)):
                table[place] = int(row.group(1))
    return table


def module_name(package: Path, path: Path) -> str:
    """``choose/attention.py`` -> ``attn_backends.choose.attention``."""
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: Path, path: Path) -> set[str]:
    """Modules of ``package`` that ``path`` imports, every import statement counted."""
    name = module_name(package, path)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    known = {module_name(package, p) for p in package.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:  # `from . import x` may name a module
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    top = package.name
    return {m for m in found if (m == top or m.startswith(top + ".")) and m != name}


def graph(package: Path) -> dict[str, set[str]]:
    return {module_name(package, p): imports(package, p) for p in package.rglob("*.py")}


def layer_of(module: str, table: dict[str, int]) -> int:
    rest = module.split(".")[1:]
    if not rest:
        return table["__init__.py"]
    if f"{rest[0]}/" in table:
        return table[f"{rest[0]}/"]
    return table[f"{rest[0]}.py"]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def climbing(edges: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    # A package's __init__ is imported with any of its modules: it is the parent
    # package, not an edge of the graph, so only explicit imports are judged.
    return sorted(f"{a} (layer {layer_of(a, table)}) imports {b} (layer {layer_of(b, table)})"
                  for a, targets in edges.items() for b in targets
                  if layer_of(b, table) > layer_of(a, table))


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_check_sees_a_climbing_import():
    table = {"contract/": 1, "choose/": 2, "__init__.py": 7}
    edges = {"attn_backends.contract.call": {"attn_backends.choose.select"},
             "attn_backends.choose.select": {"attn_backends.contract.call"}}
    assert climbing(edges, table) == [
        "attn_backends.contract.call (layer 1) imports attn_backends.choose.select (layer 2)"]


def test_the_import_reader_counts_function_level_and_type_checking_imports(tmp_path):
    package = tmp_path / "attn_backends"
    (package / "choose").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "choose" / "__init__.py").write_text("")
    (package / "parallel.py").write_text("")
    (package / "choose" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..parallel import x\n"
        "def f():\n    from .. import parallel\n")
    assert imports(package, package / "choose" / "a.py") == {"attn_backends.parallel"}


def test_every_core_module_has_a_layer_and_no_import_climbs():
    table = layer_table(DESIGN.read_text())
    edges = graph(CORE)
    assert {"attn_backends.choose.attention", "attn_backends.parallel.sharded",
            "attn_backends.probe.prober", "attn_backends.parallel.hosts"} <= set(edges)
    unplaced = []
    for module in edges:
        try:
            layer_of(module, table)
        except KeyError:
            unplaced.append(module)
    assert unplaced == [], f"modules docs/DESIGN.md's layer table does not place: {unplaced}"
    assert climbing(edges, table) == []


@pytest.mark.parametrize("package", PACKAGES + INTERFACES, ids=lambda p: p.name)
def test_no_import_circle(package):
    assert cycles(graph(package)) == []


#: A fake backend in a fresh process: core's tests need no plugin.
_FAKE = ("import sys\n"
         f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
         "from _support import Plugin, make_backend\n"
         "registry = attn_backends.Registry(plugins=[Plugin(make_backend('fake'))], "
         "autoload=False, probe=None)\n")


def _run(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


_LOADED = ("import json, sys\n"
           "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'attn_backends')\n")


def test_import_loads_at_most_fifteen_modules_and_nothing_above_choosing():
    loaded = _run("import attn_backends\n" + _LOADED + "print(json.dumps(loaded))")
    assert len(loaded) <= IMPORT_BUDGET, loaded
    above = [m for m in loaded if m.split(".")[1:2] in (["probe"], ["parallel"], ["cli"])]
    assert above == []


def test_a_single_device_call_under_jit_never_imports_the_parallel_layer():
    loaded = _run(
        "import jax, jax.numpy as jnp\nimport attn_backends\n" + _FAKE +
        "att = registry.get(device='cpu')\n"
        "q = jnp.ones((2, 8, 4, 16)); k = v = jnp.ones((2, 8, 2, 16))\n"
        "jax.jit(lambda q, k, v: att(q, k, v, causal=True))(q, k, v).block_until_ready()\n"
        "jax.grad(lambda q: att(q, k, v).sum())(q).block_until_ready()\n"
        "str(att.explain(q, k, v))\n" + _LOADED + "print(json.dumps(loaded))")
    assert "attn_backends.choose.attention" in loaded
    assert [m for m in loaded if m.startswith("attn_backends.parallel")] == []
    # Nor what only multi-process runs need (one process here).
    assert "attn_backends.choose.local" not in loaded


#: Most of core's modules a plain call loads once its verdict is on disk.
PLAIN_CALL_BUDGET = 22
#: What reads a stored verdict: all of judging a plain call may load.
VERDICT_READERS = {"attn_backends.probe", "attn_backends.probe.prober",
                   "attn_backends.probe.call", "attn_backends.probe.digests",
                   "attn_backends.probe.store", "attn_backends.probe.verdicts",
                   "attn_backends.probe.certificates"}


def test_a_plain_call_with_its_verdict_on_disk_is_a_straight_line(tmp_path):
    # Core's probe on (the default), one cache folder for both processes: the
    # first probes and stores the verdict, the second reads it.
    code = ("import os, jax, jax.numpy as jnp\nimport attn_backends\n"
            + _FAKE.replace(", probe=None", "") +
            "att = registry.get(device='cpu')\n"
            "q = jnp.ones((2, 8, 4, 16)); k = v = jnp.ones((2, 8, 2, 16))\n"
            "att(q, k, v, causal=True).block_until_ready()\n"
            "assert att.explain(q, k, v, causal=True).verdicts[0].probed\n"
            "import sys\nassert not [m for m in sys.modules if m.startswith("
            "('attn_backends_cli', 'attn_backends_flax'))]\n"
            + _LOADED + "print(json.dumps(loaded))")
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(tmp_path)}
    first = _run(code, env)
    loaded = _run(code, env)
    assert "attn_backends.probe.oracle" in first  # the first process probed
    assert len(loaded) <= PLAIN_CALL_BUDGET, loaded
    judging = {m for m in loaded if m.split(".")[1:2] == ["probe"]}
    assert judging <= VERDICT_READERS, judging - VERDICT_READERS
    assert [m for m in loaded if m.split(".")[1:2] == ["parallel"]
            or "paged" in m or "tolerances" in m or "oracle" in m] == []


def test_select_takes_at_most_six_parameters():
    from attn_backends.choose.select import select

    assert len(inspect.signature(select).parameters) <= 6


def test_a_sharded_input_reaches_the_parallel_layer():
    loaded = _run(
        "import jax, jax.numpy as jnp\nimport attn_backends\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "mesh = jax.make_mesh((1,), ('dp',))\n"
        "q = jax.device_put(jnp.ones((2, 8, 4, 16)), NamedSharding(mesh, P('dp')))\n"
        "k = v = jnp.ones((2, 8, 2, 16))\n" + _FAKE +
        "att = registry.get(device='cpu')\n"
        "plan = str(att.explain(q, k, v))\n" + _LOADED +
        "print(json.dumps(loaded + ['PLAN ' + plan]))")
    assert "attn_backends.parallel.sharded" in loaded
    assert any("sharding: batch over dp (1)" in line for line in loaded)


def test_cores_tests_import_no_plugin():
    plugins = {p.name for p in PACKAGES[2:]}
    helpers = [ROOT / "tests" / "_support.py", ROOT / "tests" / "conftest.py"]
    found = {}
    for path in [*sorted((ROOT / "tests" / "core").glob("*.py")), *helpers]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
        if names & plugins:
            found[path.name] = sorted(names & plugins)
    assert len(plugins) >= 6 and found == {}
