"""The parallel layer: attention on a mesh (batch and heads split per device, or the
sequence split as ring attention). It sits above choosing and calling and judging,
and attaches to them as a core plugin on the seams of contract/backend.py: this
module's hooks, imported only when a call is sharded or asks for a mesh. The
single-device :class:`~attn_backends.Attention` hands them a
:class:`~attn_backends.choose.attention.SingleDevice` (the selection callables it
wraps), never itself. docs/MANY_CHIPS.md has the user's view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..contract.backend import hookimpl
from .layout import ShardingRequest, resolve_layout
from .sharded import explain_sharded, sharded_attention

if TYPE_CHECKING:
    from ..choose.attention import SingleDevice
    from ..choose.select import Explanation
    from ..contract.call import AttentionCall, Operands


@hookimpl(trylast=True)
def attn_backends_sharding_request(mesh: Any, spec: Any, sequence_axis: str | None,
                                   ring_block: int | None) -> ShardingRequest:
    """``registry.get(mesh=, spec=, sequence_axis=, ring_block=)``, checked."""
    return ShardingRequest(mesh, spec, sequence_axis, ring_block)


@hookimpl(trylast=True)
def attn_backends_sharded_call(selection: SingleDevice, request: ShardingRequest | None,
                               call: AttentionCall, q: Any, k: Any, v: Any,
                               operands: Operands) -> Any:
    """Serve ``call`` as its inputs (or ``request``) lay it out on a mesh."""
    if len(selection.platforms) > 1:
        raise ValueError(
            f"sharded attention runs on one platform: get it with one device, not "
            f"{list(selection.platforms)}"
        )
    layout = resolve_layout(request, q, k, v)
    if layout is None:  # a request that names no mesh axis these inputs use
        backend = selection.choose(call, None, lambda: selection.explain(call))
        return selection.served(backend)(call, q, k, v, operands)
    # Local work only when the mesh it runs on is this process's too.
    return sharded_attention(selection.on(layout.mesh), call, layout, q, k, v, operands)


@hookimpl(trylast=True)
def attn_backends_sharded_explain(selection: SingleDevice, request: ShardingRequest | None,
                                  call: AttentionCall, q: Any, k: Any, v: Any) -> Explanation:
    """Every backend's verdict for ``call`` as laid out on the mesh, with the plan."""
    layout = resolve_layout(request, q, k, v)
    if layout is None:
        return selection.explain(call)
    return explain_sharded(selection.on(layout.mesh), call, layout)
