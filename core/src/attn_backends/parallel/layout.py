"""Sharded inputs: learn how q, k, v are laid out on a mesh, and check it.

Running a sharded call is ``sharded``'s (and the ring's, ``ring_run``).

The layout is a ``PartitionSpec`` over the BTNH dims of q, k and v (one spec
for all three): batch and heads may be sharded over any mesh axes, the
sequence over one axis (that is ring attention, see ``ring_run``), head_dim
never. It comes from, in this order: ``registry.get(spec=...)``; the
``NamedSharding`` of a concrete (or ``ShapeDtypeStruct``) q; under ``jit``,
``jax.typeof(q).sharding`` (meaningful for ``Explicit`` mesh axes, the default
of ``jax.make_mesh``). ``sequence_axis=`` names the ring axis when the spec
does not. The mesh is ``mesh=``, else the sharding's own, else the abstract
mesh in context (``jax.sharding.set_mesh``).

Backends whose manifest says ``partitionable`` are called as usual and XLA
partitions them (on Explicit axes inside ``jax.sharding.auto_axes``); the
others (Pallas kernels are custom calls) run inside a ``shard_map`` over the
batch and head axes, each device calling the backend on its own examples and
heads, so nothing is gathered. kv head ``h`` stays with its query heads
because heads are split into equal contiguous slices and the number of kv
heads must divide by the head axes' size (else a ValueError names the axis).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ..choose.select import Explanation
from ..contract import jax_api
from ..contract.call import AttentionCall, Operands
from ..contract.environment import sharding_of

_DIMS = ("batch", "sequence", "heads", "head_dim")


def _axes(entry: Any) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name, or a tuple of names) as a tuple of names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


@dataclass(frozen=True)
class ShardingRequest:
    """What ``registry.get(mesh=, spec=, sequence_axis=)`` asked for (None: infer it)."""

    mesh: Any = None
    spec: PartitionSpec | None = None
    sequence_axis: str | None = None
    ring_block: int | None = None

    def __post_init__(self) -> None:
        block = self.ring_block
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                                  or block < 1):
            raise ValueError(f"ring_block: expected an int >= 1 (tokens) or None, got {block!r}")
        spec = self.spec
        if spec is not None:
            if not isinstance(spec, (PartitionSpec, tuple, list)) or len(spec) > 4:
                raise ValueError(
                    "spec: expected a jax.sharding.PartitionSpec over the BTNH dims of q, k, v "
                    f"(at most 4 entries, e.g. P('dp', None, 'tp', None)), got {spec!r}"
                )
            object.__setattr__(self, "spec", PartitionSpec(*spec))
        if self.sequence_axis is not None and not isinstance(self.sequence_axis, str):
            raise ValueError(
                f"sequence_axis: expected the name of one mesh axis, got {self.sequence_axis!r}"
            )
        mesh = self.mesh
        meshes = (jax.sharding.Mesh, jax.sharding.AbstractMesh)
        if mesh is not None and not isinstance(mesh, meshes):
            raise ValueError(
                "mesh: expected a jax.sharding.Mesh or AbstractMesh, got "
                f"{type(mesh).__name__}"
            )


@dataclass(frozen=True)
class Layout:
    """Mesh axes that shard each dim of q, k, v ``[B, T, H, D]``; ``sequence`` means ring."""

    mesh: Any
    batch: tuple[str, ...] = ()
    sequence: str | None = None
    heads: tuple[str, ...] = ()
    ring_block: int | None = None

    def size(self, axes: tuple[str, ...] | str | None) -> int:
        """Devices along ``axes`` (the product of their mesh sizes)."""
        sizes = dict(self.mesh.shape)
        return functools.reduce(lambda n, a: n * sizes[a], _axes(axes), 1)

    def entry(self, axes: tuple[str, ...]) -> Any:
        return None if not axes else axes[0] if len(axes) == 1 else axes

    @property
    def qkv_spec(self) -> PartitionSpec:
        """Spec of q, k, v and out ``[B, T, H, D]``."""
        return PartitionSpec(self.entry(self.batch), self.sequence, self.entry(self.heads), None)

    @property
    def lse_spec(self) -> PartitionSpec:
        """Spec of lse ``[B, H, T]``."""
        return PartitionSpec(self.entry(self.batch), self.entry(self.heads), self.sequence)

    def describe(self) -> str:
        parts = []
        for dim, axes in (("batch", self.batch), ("heads", self.heads)):
            if axes:
                parts.append(f"{dim} over {'x'.join(axes)} ({self.size(axes)})")
        if self.sequence:
            parts.append(f"sequence over {self.sequence} ({self.size(self.sequence)}): ring")
        return ", ".join(parts) or "replicated"


def _spec_from(name: str, x: Any) -> tuple[Any, PartitionSpec | None]:
    sharding = sharding_of(x)
    if sharding is None or jax_api.is_single_device_sharding(sharding):
        return None, None
    if isinstance(sharding, jax.sharding.NamedSharding):
        if sharding.mesh.empty:
            return None, None
        return sharding.mesh, PartitionSpec(*sharding.spec)
    if getattr(sharding, "is_fully_replicated", False):
        return None, None
    raise ValueError(
        f"{name}: sharded by a {type(sharding).__name__}, which names no mesh axes; "
        "expected a jax.sharding.NamedSharding, or pass mesh= and spec= to registry.get"
    )


def _padded(spec: PartitionSpec | None) -> tuple[Any, ...]:
    entries = tuple(spec) if spec is not None else ()
    return entries + (None,) * (4 - len(entries))


def resolve_layout(request: ShardingRequest | None, q: Any, k: Any, v: Any) -> Layout | None:
    """The layout of this call, or None when nothing is sharded (the plain path)."""
    request = request or ShardingRequest()
    found_mesh, found = _spec_from("q", q)
    spec = request.spec
    if spec is not None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            own_mesh, actual = _spec_from(name, x)
            # Under jit the type shows the Explicit axes only: compare those.
            want = (_explicit_part(own_mesh, spec) if isinstance(x, jax.core.Tracer)
                    and own_mesh is not None else spec)
            if actual is not None and any(actual) and _padded(actual) != _padded(want):
                raise ValueError(
                    f"{name}: sharded as {actual}, but spec={spec} was asked for; serving it "
                    "would move q, k, v between devices: reshard them first, or drop spec="
                )
    else:
        spec = found
        for name, x in (("k", k), ("v", v)):
            _, other = _spec_from(name, x)
            if other is not None and spec is not None and _padded(other) != _padded(spec):
                raise ValueError(
                    f"{name}: sharded as {other}, expected the same spec as q ({spec}); "
                    "q, k and v share one layout (reshard them, or pass spec=)"
                )
    # The mesh: mesh=, else q's own (concrete, or a tracer's abstract one: no
    # context needed), else the one in context.
    mesh = request.mesh if request.mesh is not None else found_mesh
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        mesh = None if context.empty else context
    entries = list(_padded(spec))
    if request.sequence_axis is not None:
        if entries[1] not in (None, request.sequence_axis):
            raise ValueError(
                f"sequence_axis={request.sequence_axis!r}: the sequence dim is already "
                f"sharded over {entries[1]!r}; they must agree"
            )
        entries[1] = request.sequence_axis
    if not any(entries):
        return None
    if mesh is None:
        raise ValueError(
            f"mesh: the spec {PartitionSpec(*entries)} names mesh axes but no mesh is known; "
            "pass mesh= to registry.get, or call inside jax.sharding.set_mesh(mesh)"
        )
    return _layout(mesh, entries, request.ring_block)


def _layout(mesh: Any, entries: list[Any], ring_block: int | None) -> Layout:
    names = tuple(mesh.axis_names)
    for dim, entry in zip(_DIMS, entries, strict=True):
        for axis in _axes(entry):
            if axis not in names:
                raise ValueError(
                    f"spec: {dim} is sharded over {axis!r}, which is not an axis of the "
                    f"mesh (axes: {', '.join(names)})"
                )
    if entries[3] is not None:
        raise ValueError(
            f"spec: head_dim is sharded over {entries[3]!r}; attention needs whole head "
            "vectors on each device: reshard q, k, v with head_dim replicated (None)"
        )
    sequence = _axes(entries[1])
    if len(sequence) > 1:
        raise ValueError(
            f"spec: the sequence dim is sharded over {sequence}; ring attention runs over "
            "exactly one mesh axis"
        )
    used = _axes(entries[0]) + sequence + _axes(entries[2])
    if len(set(used)) != len(used):
        raise ValueError(f"spec: a mesh axis shards two dims of q, k, v ({entries})")
    return Layout(mesh, _axes(entries[0]), sequence[0] if sequence else None, _axes(entries[2]),
                  ring_block)


def check_layout(layout: Layout, call: AttentionCall) -> None:
    """ValueError naming the mesh axis when ``call``'s shapes cannot be split as ``layout``."""
    nb, nh = layout.size(layout.batch), layout.size(layout.heads)
    if call.batch % nb:
        raise ValueError(
            f"batch B={call.batch} is not divisible by the {nb} devices of mesh axis "
            f"{'x'.join(layout.batch)}"
        )
    if call.kv_heads % nh:
        raise ValueError(
            f"heads: mesh axis {'x'.join(layout.heads)} splits heads over {nh} devices, but "
            f"the kv heads Hkv={call.kv_heads} do not divide by {nh}, so a query group "
            f"(Hq/Hkv={call.group}) would be split from its kv head. Shard heads over an axis "
            f"whose size divides {call.kv_heads}, or replicate heads (None in the spec)"
        )


@dataclass(frozen=True)
class ShardedExplanation(Explanation):
    """An :class:`Explanation` plus how the call is laid out and run on the mesh."""

    plan: str = ""

    @classmethod
    def of(cls, base: Explanation, plan: str) -> ShardedExplanation:
        """``base`` with the sharding ``plan`` beside it."""
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                   plan=plan)

    def as_dict(self) -> dict[str, object]:
        return {**super().as_dict(), "sharding": self.plan}

    def __str__(self) -> str:
        lines = str(super().__str__()).split("\n")
        return "\n".join(lines[:2] + [f"sharding: {self.plan}"] + lines[2:])


def _local(call: AttentionCall, layout: Layout) -> AttentionCall:
    """The call one device sees when batch and heads are split (sequence untouched)."""
    nb, nh = layout.size(layout.batch), layout.size(layout.heads)

    def pairwise(shape: Any) -> Any:
        if shape is None:
            return None
        b, h = shape[0] // nb if shape[0] > 1 else 1, shape[1] // nh if shape[1] > 1 else 1
        return (b, h, *shape[2:])

    return dataclasses.replace(
        call,
        batch=call.batch // nb,
        q_heads=call.q_heads // nh,
        kv_heads=call.kv_heads // nh,
        mask_shape=pairwise(call.mask_shape),
        bias_shape=pairwise(call.bias_shape),
    )


def operand_specs(layout: Layout, call: AttentionCall, ops: dict[str, Any]) -> dict[str, Any]:
    """Specs of the present operands: ids ``[B, T]``, lengths ``[B]``, mask/bias
    ``[B|1, H|1, Tq, Tk]``."""
    b, t, h = layout.entry(layout.batch), layout.sequence, layout.entry(layout.heads)
    specs = {}
    for name, x in ops.items():
        if name.endswith("segment_ids"):
            specs[name] = PartitionSpec(b, t)
        elif name.endswith("lengths"):
            specs[name] = PartitionSpec(b)
        else:
            specs[name] = PartitionSpec(
                b if x.shape[0] > 1 else None, h if x.shape[1] > 1 else None, None, None
            )
    return specs


def present(operands: Operands) -> dict[str, Any]:
    return {name: x for name, x in operands._asdict().items() if x is not None}


def _explicit(layout: Layout, axes: list[str] | tuple[str, ...]) -> bool:
    """Whether any of ``axes`` is an Explicit axis of the layout's mesh."""
    types = dict(zip(layout.mesh.axis_names, layout.mesh.axis_types, strict=True))
    return any(types[a] == jax.sharding.AxisType.Explicit for a in axes)


def place(layout: Layout, x: Any, spec: PartitionSpec) -> Any:
    """``x`` laid out as ``spec``, as shard_map needs on Explicit mesh axes.

    Auto axes need nothing (shard_map reshards its inputs). An array already so
    sharded is unchanged; a replicated one is sliced, never gathered.
    """
    if not _explicit(layout, [a for entry in spec for a in _axes(entry)]):
        return x
    return jax.sharding.reshard(x, explicit_sharding(layout, spec))


def unmapped_axes(layout: Layout) -> frozenset[str]:
    """The layout's mesh axes not already manual: inside a user's ``shard_map``
    over some of them (``axis_names=``) the others are still this call's to map."""
    return frozenset(a for a, t in zip(layout.mesh.axis_names, layout.mesh.axis_types,
                                       strict=True) if t != jax.sharding.AxisType.Manual)


def explicit_sharding(layout: Layout, spec: PartitionSpec) -> jax.sharding.NamedSharding:
    """``spec`` on the layout's mesh with its Auto axes left out: what a sharding in
    types (``reshard``, ``auto_axes``' out_sharding) may name on a mixed mesh."""
    return jax.sharding.NamedSharding(layout.mesh, _explicit_part(layout.mesh, spec))


def _explicit_part(mesh: Any, spec: PartitionSpec) -> PartitionSpec:
    """``spec`` naming only ``mesh``'s Explicit axes: what a tracer's type shows."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))

    def kept(entry: Any) -> Any:
        axes = tuple(a for a in _axes(entry) if types.get(a) == jax.sharding.AxisType.Explicit)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return PartitionSpec(*map(kept, spec))


def place_all(layout: Layout, specs: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """:func:`place` over matching trees of specs and arrays (q, k, v, operand dict)."""
    return tuple(
        jax.tree.map(lambda s, x: place(layout, x, s), spec, arg,
                     is_leaf=lambda s: isinstance(s, PartitionSpec))
        for spec, arg in zip(specs, args, strict=True)
    )
