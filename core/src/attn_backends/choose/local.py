"""Local work in a multi-process run: calls one process makes on its own devices.

When ``jax.process_count() > 1`` every selection is agreed by all processes
(``attn_backends.parallel.hosts``), because they trace one SPMD program. A call
that runs on this process's devices only has no collective with anyone, so it is
selected here alone, as on one host (docs/MANY_CHIPS.md, "Local work"):

- eager, every operand concrete (or a value under ``jax.grad`` without ``jit``)
  and fully addressable by this process: local, found out, nothing to mark;
- traced (``jax.jit``), where a tracer does not say where it will run: agreed,
  unless made inside ``local_work()`` (contract/environment.py, which makes its
  context at import: JAX's ``make_user_context`` must not run beside other JAX
  calls; this module loads on a multi-process run's first call);
- a call JAX knows spans processes (an operand on another process's devices, a
  mesh in context or laid out on that holds them, or more devices than this
  process has): agreed, and refused when marked local.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ..contract import jax_api
from ..contract.environment import marked, sharding_of
from ..contract.errors import UnsupportedError


def _others(devices: Any) -> list[int]:
    return sorted({d.process_index for d in devices} - {jax.process_index()})


def _mesh_span(mesh: Any, what: str) -> str | None:
    """Why ``mesh`` spans processes, or None when it does not or JAX cannot tell
    (an abstract mesh no larger than this process's device count)."""
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        others = _others(mesh.devices.flat)
        return f"{what} holds devices of process(es) {others}" if others else None
    here = jax.local_device_count()
    if mesh.size > here:
        return f"{what} has {mesh.size} devices, more than this process's {here}"
    return None


def _array_span(name: str, x: Any) -> str | None:
    """Why operand ``x`` (an array, tracer or ShapeDtypeStruct) spans processes, or
    None when it does not or JAX cannot tell."""
    if isinstance(x, jax.core.Tracer) and x.to_concrete_value() is not None:
        x = x.to_concrete_value()  # under jax.grad alone: the array it runs on
    sharding = sharding_of(x)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        return _mesh_span(mesh, f"{name}'s mesh")  # a tracer's: abstract
    if sharding is None:
        return None
    others = _others(sharding.device_set)
    return f"{name} is on devices of process(es) {others}" if others else None


def _concrete_here(x: Any) -> bool:
    """Whether ``x`` holds a value here: not traced under ``jit`` (under
    ``jax.grad`` alone a tracer has one) nor a ShapeDtypeStruct."""
    if isinstance(x, jax.core.Tracer):
        return x.to_concrete_value() is not None
    return not isinstance(x, jax.ShapeDtypeStruct)


def _context_mesh() -> tuple[Any, str]:
    """The mesh in JAX's context (``jax.sharding.set_mesh``): host data there is
    laid out over it (eager or traced), and a trace may be."""
    concrete = jax_api.context_mesh()
    if concrete is not None and not concrete.empty:
        return concrete, "the mesh in context (jax.sharding.set_mesh)"
    return jax.sharding.get_abstract_mesh(), "the abstract mesh in context"


def spans(arrays: dict[str, Any], meshes: Sequence[tuple[Any, str]] = ()) -> list[str]:
    """Why a call on ``arrays`` (name -> operand), laid out on ``meshes`` ((mesh,
    its name) pairs) and the mesh in context, runs on other processes' devices
    too, as far as JAX knows (empty: it does not, or JAX cannot tell)."""
    found = [why for mesh, name in [*meshes, _context_mesh()]
             if (why := _mesh_span(mesh, name)) is not None]
    return found + [why for name, x in arrays.items()
                    if (why := _array_span(name, x)) is not None]


def require_local(what: str, reasons: Sequence[str]) -> None:
    """Refuse local work ``what`` that spans processes (``reasons``: :func:`spans`)."""
    if reasons:
        raise UnsupportedError(
            f"{what} is local work (marked by attn_backends.local_work()), but it spans "
            f"processes: {'; '.join(reasons)}. Local work runs on this process's devices "
            "only: give it arrays of this process's devices, outside the set_mesh block "
            "of a mesh over several processes; or make the call on every process, "
            "unmarked, so the processes agree on its backend")


def is_local(what: str, arrays: dict[str, Any], meshes: Sequence[tuple[Any, str]] = ()) -> bool:
    """Whether the call ``what`` on ``arrays`` (laid out on ``meshes``: see
    :func:`spans`) is selected by this process alone. Asked only when several
    processes run. Raises UnsupportedError for a call marked local
    (:func:`local_work`) that JAX knows spans processes."""
    reasons = spans(arrays, meshes)
    if marked():
        require_local(what, reasons)
        return True
    return not reasons and all(_concrete_here(x) for x in arrays.values())
