"""Ring attention through the registry: plan, backend choice, zigzag order, shard_map.

A call whose sequence dim is sharded over a mesh axis (``sequence_axis=`` or a
spec/sharding naming it) runs as a ring over that axis (see ``ring``), inside
one ``shard_map`` that also splits batch and heads as the layout says. The
per-block calls go to one backend, chosen like any call but judged on every
per-block call the ring will make (so explain shows why a backend cannot run
in a ring, e.g. no ``return_lse``, or no ``lengths`` when kv_lengths are given).

Causal calls are balanced with the zigzag order: q, k, v arrive split in
contiguous slices (device r holds chunks 2r and 2r+1 of 2P); ``ppermute``
moves them, one sub-chunk at a time into place, so device r holds chunks r
and 2P-1-r, and the output moves back (whole chunks: by then nothing else is
live). Users see ordinary contiguous sharding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from ..choose.dispatch import Served
from ..choose.select import Explanation
from ..contract import jax_api
from ..contract.call import AttentionCall, Operands
from ..contract.errors import UnsupportedError
from .layout import Layout, ShardedExplanation, _local, operand_specs, place_all, present
from .ring import RingPlan, ring_fn

if TYPE_CHECKING:
    from ..choose.attention import SingleDevice
    from ..contract.backend import Backend

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


#: Default longest sub-chunk (tokens) per backend call inside the ring.
RING_BLOCK = 1024


def _splits(q_len: int, kv_len: int, block: int) -> int:
    """How many sub-chunks to cut a ``(q_len, kv_len)`` chunk pair into.

    Sub-chunks divide both lengths evenly (each backend call has one static
    shape): the fewest no longer than ``block``. When those would be shorter
    than ``block / 2`` (a length with no divisor near ``block``, such as a
    prime, would otherwise fall to one-token calls, millions of them), the
    shortest sub-chunks longer than ``block`` instead: an awkward length costs
    memory, not time.
    """
    g = math.gcd(q_len, kv_len)
    longest = max(q_len, kv_len)
    divisors = [n for n in range(1, g + 1) if g % n == 0]
    fitting = [n for n in divisors if longest // n <= block]
    if not fitting:
        return g
    n = fitting[0]
    if n == 1 or 2 * (longest // n) >= block:
        return n
    return max(d for d in divisors if d < n)


def ring_plan(call: AttentionCall, layout: Layout) -> RingPlan:
    """The per-pair calls of ``call`` as a ring over ``layout.sequence``; raises if impossible.

    ``layout.ring_block`` bounds the sub-chunk length of each backend call
    (default :data:`RING_BLOCK`).
    """
    block = layout.ring_block or RING_BLOCK
    axis = layout.sequence
    assert axis is not None
    p = layout.size(axis)
    where = f"ring attention (sequence sharded over {axis!r})"
    for feature, used in (("window", call.window is not None),
                          ("mask", call.mask_shape is not None),
                          ("bias", call.bias_shape is not None)):
        if used:
            raise UnsupportedError(
                f"{where} does not support {feature}: it is a [Tq, Tk] structure the blocks "
                "would have to split; use causal, segment_ids or kv_lengths, or do not shard "
                "the sequence"
            )
    if call.dtype not in _ITEMSIZE:
        raise UnsupportedError(
            f"{where} does not serve {call.dtype}: it merges the blocks' partial results in "
            "float32, which would drop float64's precision; do not shard the sequence of a "
            "float64 call (sharding the batch or heads keeps it)"
        )
    local = dataclasses.replace(_local(call, layout), q_lengths=False, return_lse=True)
    if call.causal:
        if call.q_len != call.kv_len:
            raise UnsupportedError(
                f"{where}: causal needs Tq == Tk (self-attention), got Tq={call.q_len}, "
                f"Tk={call.kv_len}"
            )
        if call.q_len % (2 * p):
            raise ValueError(
                f"{where}: causal splits the sequence into 2 x {p} chunks (zigzag), so "
                f"T={call.q_len} must be divisible by {2 * p}"
            )
        c = call.q_len // (2 * p)
        n = _splits(c, c, block)
        diag = dataclasses.replace(local, q_len=c // n, kv_len=c // n)
        return RingPlan(axis, p, True, n, dataclasses.replace(diag, causal=False), diag)
    for name, length in (("Tq", call.q_len), ("Tk", call.kv_len)):
        if length % p:
            raise ValueError(f"{where}: {name}={length} must be divisible by {p} devices")
    tq, tk = call.q_len // p, call.kv_len // p
    n = _splits(tq, tk, block)
    full = dataclasses.replace(local, q_len=tq // n, kv_len=tk // n)
    return RingPlan(axis, p, False, n, full)


def ring_bytes_per_step(call: AttentionCall, layout: Layout) -> int:
    """Bytes one device sends per forward ring step: its k and v block (+ kv ids)."""
    local = _local(call, layout)
    t = call.kv_len // layout.size(layout.sequence)
    size = local.batch * t * local.kv_heads * (call.head_dim + call.v_head_dim)
    ids = local.batch * t * 4 if call.segment_ids else 0
    return size * _ITEMSIZE[call.dtype] + ids



def _ring_reasons(backend: Backend) -> list[str]:
    if not backend.capabilities.return_lse:
        return ["ring: partial results are merged by their lse, and this backend does not "
                "declare return_lse"]
    return []


def explain_ring(single: SingleDevice, call: AttentionCall, layout: Layout) -> Explanation:
    """Verdicts of every backend on all the per-block calls of the ring, and the choice."""
    plan = ring_plan(call, layout)
    base = single.explain(call, calls_for=lambda backend: plan.calls,
                                  reasons_for=_ring_reasons)
    order = "zigzag order (causal load balance)" if plan.zigzag else "contiguous order"
    step = ring_bytes_per_step(call, layout)
    calls = " and ".join(c.describe() for c in plan.calls)
    text = (f"{layout.describe()}; {plan.size} steps, {order}; per sub-chunk pair the backend "
            f"gets {calls}; ppermute {step} bytes per device per step")
    return ShardedExplanation.of(base, text)


def _zigzag_perms(p: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each device's first and second contiguous chunk go in zigzag order."""
    def home(chunk: int) -> int:
        return chunk if chunk < p else 2 * p - 1 - chunk

    return [(r, home(2 * r)) for r in range(p)], [(r, home(2 * r + 1)) for r in range(p)]


def _send_chunk(z: Any, x: Any, axis: str, perm: list[tuple[int, int]], src: Any, dst: Any,
                pieces: int, dim: int) -> Any:
    """Send the chunk (half of ``dim``) of x at ``src`` along ``perm`` into z at ``dst``.

    Piece by piece, each written in place: only one piece is in flight, not
    a copy of the chunk.
    """
    n = x.shape[dim] // 2 // pieces

    def one(j: Any, z: Any) -> Any:
        part = jax.lax.dynamic_slice_in_dim(x, src + j * n, n, dim)
        part = jax.lax.ppermute(part, axis, perm)
        return jax.lax.dynamic_update_slice_in_dim(z, part, dst + j * n, dim)

    return jax.lax.fori_loop(0, pieces, one, z)


def _zigzag_pieces(x: Any, axis: str, p: int, dim: int, pieces: int) -> Any:
    """Contiguous chunks (2r, 2r+1) on device r -> zigzag chunks (r, 2P-1-r),
    each chunk sent in ``pieces`` pieces (see :func:`_send_chunk`)."""
    half = x.shape[dim] // 2
    even_perm, odd_perm = _zigzag_perms(p)
    # Device d holds chunk d first: even d gets it from the even chunks.
    even = jax.lax.axis_index(axis) % 2 == 0
    z = _send_chunk(jnp.zeros_like(x), x, axis, even_perm, 0, jnp.where(even, 0, half),
                    pieces, dim)
    return _send_chunk(z, x, axis, odd_perm, half, jnp.where(even, half, 0), pieces, dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _to_zigzag(x: Any, axis: str, p: int, dim: int, pieces: int) -> Any:
    """:func:`_zigzag_pieces`, differentiable. A permutation, so its VJP is the
    inverse permutation; JAX's own VJP of the piece loop would keep every
    piece as a residual."""
    return _zigzag_pieces(x, axis, p, dim, pieces)


def _to_zigzag_fwd(x: Any, axis: str, p: int, dim: int, pieces: int) -> tuple[Any, None]:
    return _zigzag_pieces(x, axis, p, dim, pieces), None


def _to_zigzag_bwd(axis: str, p: int, dim: int, pieces: int, _: None, ct: Any) -> tuple[Any]:
    return (_from_zigzag(ct, axis, p, dim),)


_to_zigzag.defvjp(_to_zigzag_fwd, _to_zigzag_bwd)


def _from_zigzag(x: Any, axis: str, p: int, dim: int) -> Any:
    """Inverse of :func:`_to_zigzag`."""
    first, second = jnp.split(x, 2, axis=dim)
    even_perm, odd_perm = _zigzag_perms(p)
    even = jax.lax.axis_index(axis) % 2 == 0
    a = jnp.where(even, first, second)
    b = jnp.where(even, second, first)
    a = jax.lax.ppermute(a, axis, [(d, s) for s, d in even_perm])
    b = jax.lax.ppermute(b, axis, [(d, s) for s, d in odd_perm])
    return jnp.concatenate([a, b], axis=dim)


def _positions(plan: RingPlan) -> Any:
    """Global sequence positions ``[Tq_local]`` of this device's query rows."""
    r = jax.lax.axis_index(plan.axis)
    c = plan.full.q_len * plan.splits
    rows = jnp.arange(c)
    if not plan.zigzag:
        return r * c + rows
    return jnp.concatenate([r * c + rows, (2 * plan.size - 1 - r) * c + rows])


@functools.lru_cache(maxsize=64)
def _ring_callable(served: Served, call: AttentionCall, layout: Layout,
                   names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> Any:
    plan = ring_plan(call, layout)
    ring = ring_fn(plan, served)
    axis, p = plan.axis, plan.size
    fake = {n: jax.ShapeDtypeStruct(s, "int32") for n, s in zip(names, shapes, strict=True)}
    specs = operand_specs(layout, call, fake)

    def body(q: Any, k: Any, v: Any, ops: dict[str, Any]) -> Any:
        ext = {n: ops[n] for n in ("q_segment_ids", "kv_segment_ids", "kv_lengths") if n in ops}
        if plan.zigzag:
            q, k, v = (_to_zigzag(x, axis, p, 1, plan.splits) for x in (q, k, v))
            ext = {n: x if n == "kv_lengths" else _zigzag_pieces(x, axis, p, 1, plan.splits)
                   for n, x in ext.items()}
        out, lse = ring(q, k, v, ext)
        if "q_lengths" in ops:
            valid = _positions(plan)[None, :] < ops["q_lengths"][:, None]  # [B, Tq_local]
            out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
            lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
        if plan.zigzag:
            out, lse = _from_zigzag(out, axis, p, 1), _from_zigzag(lse, axis, p, 2)
        return (out, lse) if call.return_lse else out

    out_specs = (layout.qkv_spec, layout.lse_spec) if call.return_lse else layout.qkv_spec
    spec = layout.qkv_spec
    in_specs = (spec, spec, spec, specs)
    mapped = jax_api.shard_map(body, mesh=layout.mesh, in_specs=in_specs,
                               out_specs=out_specs, check_vma=False)
    return jax.jit(lambda *args: mapped(*place_all(layout, in_specs, args)))


def ring_attention_call(single: SingleDevice, call: AttentionCall, layout: Layout,
                        q: Any, k: Any, v: Any, operands: Operands) -> Any:
    """Run ``call`` as ring attention over ``layout.sequence`` (q, k, v global arrays)."""
    ring_plan(call, layout)  # layout errors before selection warnings
    served = single.served(
        single.choose(call, layout, lambda: explain_ring(single, call, layout)))
    ops = present(operands)
    key = (served, call, layout, tuple(ops), tuple(tuple(x.shape) for x in ops.values()))
    try:
        fn = _ring_callable(*key)
    except TypeError:  # unhashable backend options: build uncached
        fn = _ring_callable.__wrapped__(*key)
    with jax.named_scope("attn/ring"):
        return fn(q, k, v, ops)

