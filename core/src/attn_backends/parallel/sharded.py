"""Serving a sharded call: ring, XLA-partitioned, or per device in shard_map.

Sits above the layout code (``layout``) and the ring (``ring_run``); it gets
from the single-device attention it serves only the callables of
:class:`~attn_backends.choose.attention.SingleDevice`: selection (explain and
choose), a backend bound as core calls every backend (``served``), and a
backend by name.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax

from ..choose.dispatch import Served
from ..choose.select import Explanation
from ..contract import jax_api
from ..contract.call import AttentionCall, Operands
from .layout import (
    Layout,
    ShardedExplanation,
    _explicit,
    _local,
    check_layout,
    explicit_sharding,
    operand_specs,
    place_all,
    present,
    unmapped_axes,
)
from .ring_run import explain_ring, ring_attention_call

if TYPE_CHECKING:
    from ..choose.attention import SingleDevice
    from ..contract.backend import Backend


@functools.lru_cache(maxsize=128)
def _split_fn(served: Served, call: AttentionCall, layout: Layout,
              names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> Any:
    """jit(shard_map(served)) over the batch and head axes of ``layout``."""
    local = _local(call, layout)
    fake = {n: jax.ShapeDtypeStruct(s, "int32") for n, s in zip(names, shapes, strict=True)}
    specs = operand_specs(layout, call, fake)
    out_specs = (layout.qkv_spec, layout.lse_spec) if call.return_lse else layout.qkv_spec

    def body(q: Any, k: Any, v: Any, ops: dict[str, Any]) -> Any:
        return served(local, q, k, v, Operands(**ops))

    spec = layout.qkv_spec
    in_specs = (spec, spec, spec, specs)
    # Typed by the manual axes when every backend keeps that typing (check_vma):
    # then it nests in a user's own shard_map over the mesh's other axes.
    typed = all(backend.capabilities.check_vma for _, backend in served.backends)
    mapped = jax_api.shard_map(
        body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=typed,
        axis_names=unmapped_axes(layout),
    )
    return jax.jit(lambda *args: mapped(*place_all(layout, in_specs, args)))


def run_split(served: Served, call: AttentionCall, layout: Layout,
              q: Any, k: Any, v: Any, operands: Operands) -> Any:
    """Run a non-partitionable backend per device over batch/head shards (no gather)."""
    ops = present(operands)
    names = tuple(ops)
    shapes = tuple(tuple(x.shape) for x in ops.values())
    try:
        fn = _split_fn(served, call, layout, names, shapes)
    except TypeError:  # unhashable backend options: build uncached
        fn = _split_fn.__wrapped__(served, call, layout, names, shapes)
    return fn(q, k, v, ops)


def _run_partitioned(single: SingleDevice, backend: Backend, call: AttentionCall, layout: Layout,
                     q: Any, k: Any, v: Any, operands: Operands) -> Any:
    """Run a partitionable backend on the global arrays and let XLA partition it.

    "Partitionable" promises XLA's automatic partitioning, not sharding in
    types: a backend's loops and reshapes need not carry Explicit shardings
    (xla_native's loop carries do not). So on Explicit axes the backend runs
    with the mesh's axes Auto (``jax.sharding.auto_axes``), and its output
    comes back laid out as q (lse as ``[B, H, T]`` with the same axes).
    """
    run = functools.partial(single.served(backend), call)
    if not _explicit(layout, (*layout.batch, *layout.heads)):
        return run(q, k, v, operands)
    out = explicit_sharding(layout, layout.qkv_spec)
    if call.return_lse:
        out = (out, explicit_sharding(layout, layout.lse_spec))
    explicit = tuple(a for a in sorted(unmapped_axes(layout)) if _explicit(layout, [a]))
    return jax.sharding.auto_axes(run, axes=explicit, out_sharding=out)(q, k, v, operands)


def sharded_attention(single: SingleDevice, call: AttentionCall, layout: Layout,
                      q: Any, k: Any, v: Any, operands: Operands) -> Any:
    """Serve ``call`` laid out as ``layout``: ring, XLA-partitioned, or shard_map'd."""
    check_layout(layout, call)
    if layout.sequence is not None:
        return ring_attention_call(single, call, layout, q, k, v, operands)
    backend = single.choose(call, layout, lambda: explain_sharded(single, call, layout))
    if backend.capabilities.partitionable:
        return _run_partitioned(single, backend, call, layout, q, k, v, operands)
    return run_split(single.served(backend), call, layout, q, k, v, operands)


def explain_sharded(single: SingleDevice, call: AttentionCall, layout: Layout) -> Explanation:
    """Every backend's verdict for ``call`` laid out as ``layout``, with the plan."""
    check_layout(layout, call)
    if layout.sequence is not None:
        return explain_ring(single, call, layout)
    local = _local(call, layout)

    def calls_for(backend: Backend) -> list[AttentionCall]:
        # A backend XLA cannot partition runs per device: judge what it will see.
        return [call if backend.capabilities.partitionable else local]

    base = single.explain(call, calls_for=calls_for)
    plan = layout.describe()
    if base.chosen is not None:
        chosen = single.backend(base.chosen)
        how = (
            "partitionable: XLA partitions it" if chosen.capabilities.partitionable
            else "not partitionable: run per device in shard_map over the batch/head axes, "
            f"each device calling it with {chosen.capabilities.served_call(local).describe()}"
        )
        plan += f"; {base.chosen} is {how}"
    return ShardedExplanation.of(base, plan)
