"""Running a backend only on the platform it was selected for.

Selection happens at trace time, but JAX learns the platform a program runs on
only when it lowers it (``jax.jit`` for the local devices, ``jax.export`` for
the listed ones). So every backend call goes through
``jax.lax.platform_dependent``: the backend selected for a platform is the
branch of that platform's lowering names, and every other lowering gets a
placeholder whose one primitive refuses to lower, raising
:class:`PlatformUnavailableError`. Lowering for one platform lowers only its
own branch, so a single-platform program is the backend's code alone; an
export for several platforms carries one branch per platform, and a Pallas
kernel (which has no lowering off its platform) can be one of them only when
the export leaves out the platforms it cannot lower for.

The gradient guards and the empty-call result are here too: every path that
calls a backend runs them through :class:`Served`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..contract.backend import Backend
from ..contract.call import AttentionCall, Operands
from ..contract.environment import (
    lowering_names,
    platform_name,
    vary_like,
    varying_axes,
    visible_platforms,
)
from ..contract.errors import PlatformUnavailableError, UnsupportedError


def unavailable_message(selected: Sequence[str], lowering: Sequence[str] = ()) -> str:
    """Why attention selected for ``selected`` cannot run (or lower) for ``lowering``."""
    visible = visible_platforms()
    absent = [p for p in selected if p not in visible]
    if len(selected) == 1 and absent:
        platform = selected[0]
        return (
            f"device={platform!r}: JAX sees no {platform} here (visible: "
            f"{', '.join(visible) or 'none'}). Selection for an absent platform serves "
            "ahead-of-time export only: trace it with "
            f"jax.export.export(jax.jit(f), platforms=[{platform!r}])."
        )
    targets = sorted({platform_name(p) for p in lowering}) or ["?"]
    return (
        f"attention selected for {', '.join(selected)} is being lowered for "
        f"{', '.join(targets)} (JAX sees: {', '.join(visible) or 'none'}); a backend is "
        "lowered only for the platform it was selected for: get the attention with "
        f"registry.get(device=...) naming {' and '.join(targets)} too."
    )


def _refuse_to_lower(ctx: Any, x: Any, *, selected: tuple[str, ...]) -> Any:
    raise PlatformUnavailableError(unavailable_message(selected, ctx.module_context.platforms))


def _refuse_to_run(x: Any, *, selected: tuple[str, ...]) -> Any:
    raise PlatformUnavailableError(unavailable_message(selected))


@functools.cache
def _unavailable() -> Any:
    """Identity on its operand that refuses to lower (or run): the placeholder of
    platforms no backend was selected for. Built on first use: ``jax.extend``
    imports much of JAX (Pallas included), which ``import attn_backends`` must not."""
    from ..contract import jax_api

    primitive = jax_api.new_primitive("attn_backends_platform_unavailable")
    primitive.def_abstract_eval(lambda x, *, selected: x)
    primitive.def_impl(_refuse_to_run)
    jax_api.register_lowering(primitive, _refuse_to_lower)
    return primitive


def on_platforms(
    branches: Mapping[str, Callable[..., Any]],
    placeholder: Callable[..., Any],
    *args: Any,
) -> Any:
    """``branches[p](*args)`` when lowered for platform ``p`` (cpu, gpu, tpu or a plugin's).

    Lowering for a platform without a branch raises PlatformUnavailableError.
    ``placeholder(*args)`` returns arrays typed as every branch's result (it
    is traced, never run). Inside a user's ``shard_map`` it varies over the
    manual axes ``args`` vary over (:func:`vary_like`), as a backend's result
    does and ``platform_dependent`` requires of its branches. A backend's own
    result is never cast: one typed invariant though made from varying inputs
    would have its cotangent summed over the devices (the cast's transpose), so
    JAX's refusal of the mismatch is the right answer.
    """
    selected = tuple(sorted(branches))

    def unavailable(*args: Any) -> Any:
        unavailable_p = _unavailable()
        return jax.tree.map(lambda x: unavailable_p.bind(x, selected=selected),
                            vary_like(placeholder(*args), args))

    by_lowering = {name: fn for p, fn in branches.items() for name in lowering_names(p)}
    return jax.lax.platform_dependent(*args, default=unavailable, **by_lowering)


@dataclasses.dataclass(frozen=True)
class Served:
    """``served(call, q, k, v, operands)``: the backend selected for each platform,
    called as core always calls one.

    ``backends`` pairs each platform with its selected backend, ``options``
    each backend name with its ``backend_options`` entry. Per platform: the
    manifest refusal (:func:`refuse_unclaimed`), the gradient guards, the
    ``attn/<name>`` named scope, and ``attend`` with ``call.platform`` set to
    that platform, inside :func:`on_platforms`. The single-device, sharded and
    ring paths all call backends through this one object.
    """

    backends: tuple[tuple[str, Backend], ...]
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, backends: Mapping[str, Backend], options: Mapping[str, Any]) -> Served:
        names = {b.name for b in backends.values()}
        return cls(tuple(sorted(backends.items())),
                   tuple(sorted((n, o) for n, o in options.items() if n in names)))

    def __call__(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands) -> Any:
        options = dict(self.options)

        def branch(platform: str, backend: Backend) -> Callable[..., Any]:
            def run(q: Any, k: Any, v: Any, operands: Operands) -> Any:
                # The call this backend is judged on and given (a key mask as
                # segment ids, or as its pairwise mask): Capabilities.served_call.
                served = backend.capabilities.served_call(call)
                operands = served_operands(call, served, operands)
                refuse_unclaimed(backend, served, manual)
                q, k, v, operands = guard_gradients(backend, q, k, v, operands)
                operands = lengths_in_range(served, operands)
                attend = functools.partial(_attend_with, backend, dataclasses.replace(
                    served, platform=platform), options.get(backend.name))
                if served.kv_dtype is not None:
                    attend = forward_only(attend, (
                        f"k, v: attention over a quantized K and V ({served.kv_dtype}) is "
                        "forward only: the contract defines no gradient for it"))
                with jax.named_scope(f"attn/{backend.name}"):
                    return attend(q, k, v, operands)
            return run

        # Inside a user's shard_map: q, k, v and bias vary over every manual axis
        # any input does, before the backend (and its custom_vjp) sees them. A k
        # replicated over an axis q is split over gets, from this cast's
        # transpose, its gradient summed over that axis, as the contract says.
        manual = varying_axes(q, k, v, operands)
        if manual:
            q, k, v, bias = vary_like((q, k, v, operands.bias), q, k, v, operands)
            operands = operands._replace(bias=bias)
        branches = {platform: branch(platform, backend) for platform, backend in self.backends}
        return on_platforms(branches, lambda q, *_: empty_result(call, q), q, k, v, operands)


def _attend_with(backend: Backend, call: AttentionCall, options: Any, q: Any, k: Any, v: Any,
                 operands: Operands) -> Any:
    return backend.attend(call, q, k, v, operands, options)


def by_pass(forward: Served, differentiated: Served) -> Callable[..., Any]:
    """``f(call, q, k, v, operands)``: ``forward`` when only evaluated, and
    ``differentiated`` for the value and gradients of a differentiated call.

    A ``jax.custom_vjp`` whose primal is ``forward`` and whose forward rule runs
    ``differentiated`` under ``jax.vjp``, keeping its pullback as the residual:
    each pass is the backend measured fastest for it (docs/DESIGN.md, "Measured
    selection"), and the gradients are always those of the backend that made
    the output they belong to.
    """

    def run(call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands) -> Any:
        @jax.custom_vjp
        def attend(q: Any, k: Any, v: Any, operands: Operands) -> Any:
            return forward(call, q, k, v, operands)

        def attend_fwd(q: Any, k: Any, v: Any, operands: Operands) -> tuple[Any, Any]:
            return jax.vjp(lambda *a: differentiated(call, *a), q, k, v, operands)

        def attend_bwd(pullback: Any, cotangent: Any) -> Any:
            return pullback(cotangent)

        attend.defvjp(attend_fwd, attend_bwd)
        return attend(q, k, v, operands)

    return run


def served_operands(call: AttentionCall, served: AttentionCall, operands: Operands) -> Operands:
    """``operands`` of ``call`` as the backend given ``served`` reads them.

    ``served`` is ``Capabilities.served_call(call)``. A key mask ``[B|1, 1, 1,
    Tk]`` handed over as a pairwise mask is broadcast to ``[B|1, 1, Tq, Tk]``;
    handed over as segment ids it becomes :func:`key_mask_as_segment_ids`.
    Anything else is returned as it is.
    """
    if served == call or not call.key_mask:
        return operands
    if served.mask_shape is not None:
        return operands._replace(mask=jnp.broadcast_to(operands.mask, served.mask_shape))
    return key_mask_as_segment_ids(call, operands)


def key_mask_as_segment_ids(call: AttentionCall, operands: Operands) -> Operands:
    """The segment ids that hide exactly what the key mask ``[B|1, 1, 1, Tk]`` hides.

    Without segment ids: q ids ``[B, Tq]`` are 0, kv ids ``[B, Tk]`` 0 where the
    mask is True and 1 where it is False. With them, q ids are kept and a masked
    key takes an id no query row of its example holds (:func:`absent_ids`), so
    key j is visible to row i exactly when ids are equal and the mask is True:
    a row that sees no key still sees none (zeros, lse -inf, zero gradients, by
    the contract's segment ids). Ids narrower than 32 bits are widened to int32
    first, so an example can never hold every id of the dtype. Causal, window
    and lengths are untouched: they still apply on top.
    """
    b, tq, tk = call.batch, call.q_len, call.kv_len
    visible = jnp.broadcast_to(operands.mask.reshape(operands.mask.shape[0], tk), (b, tk))
    if operands.q_segment_ids is None:
        q_ids = jnp.zeros((b, tq), jnp.int32)
        kv_ids = jnp.where(visible, 0, 1).astype(jnp.int32)
    else:
        q_ids, kv_ids = operands.q_segment_ids, operands.kv_segment_ids
        common = jnp.promote_types(jnp.promote_types(q_ids.dtype, kv_ids.dtype), jnp.int32)
        dtype = jax.dtypes.canonicalize_dtype(common)
        q_ids, kv_ids = q_ids.astype(dtype), kv_ids.astype(dtype)
        kv_ids = jnp.where(visible, kv_ids, absent_ids(q_ids)[:, None])
    return operands._replace(mask=None, q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def absent_ids(q_ids: Any) -> Any:
    """``[B]``: per example, an id that none of its query ids ``[B, Tq]`` equals.

    ``min - 1``; when the minimum is the dtype's smallest value, the first gap
    between the sorted ids plus one; without a gap ``max + 1`` (the ids are then
    the Tq smallest values, so ``max + 1`` exists). No step can overflow.
    """
    smallest = jnp.iinfo(q_ids.dtype).min
    ordered = jnp.sort(q_ids, axis=1)
    low, high = ordered[:, 0], ordered[:, -1]
    above = high + 1
    if q_ids.shape[1] > 1:
        below, after = ordered[:, :-1], ordered[:, 1:]
        # after > below rules out after == smallest, so after - 1 cannot wrap.
        gap = (after > below) & (after - 1 != below)
        first = jnp.take_along_axis(below, jnp.argmax(gap, axis=1)[:, None], axis=1)[:, 0]
        above = jnp.where(gap.any(axis=1), first + 1, above)
    return jnp.where(low > smallest, low - 1, above)


def manual_axes_reasons(axes: frozenset[str]) -> Callable[[Backend], list[str]]:
    """Why a backend cannot serve a call whose q, k, v vary over the manual ``axes``
    of a user's ``jax.shard_map`` with ``check_vma=True`` (none when ``axes`` is
    empty, or the backend's manifest claims ``check_vma``)."""

    def reasons(backend: Backend) -> list[str]:
        if not axes or backend.capabilities.check_vma:
            return []
        return [f"q, k, v vary over the manual axes {sorted(axes)} of a jax.shard_map with "
                "check_vma=True, where its kernel cannot be traced (Capabilities.check_vma "
                "is not claimed); pass check_vma=False to that shard_map to serve it there"]

    return reasons


def manual_axes_judging(axes: frozenset[str]) -> dict[str, Any]:
    """:func:`~attn_backends.select`'s extra judging for a call whose q, k, v vary
    over the manual ``axes`` (empty: none): backends not claiming ``check_vma``
    are passed over, with :func:`manual_axes_reasons`."""
    return {"reasons_for": manual_axes_reasons(axes)} if axes else {}


def refuse_unclaimed(backend: Backend, call: AttentionCall,
                     manual: frozenset[str] = frozenset()) -> None:
    """Raise UnsupportedError when ``call`` uses what ``backend``'s manifest does not
    claim, or its q, k, v vary over the ``manual`` axes of a user's shard_map and
    it does not claim ``check_vma``.

    Core's one home for this rule: every path that hands a call to
    ``backend.attend`` runs it first, so no backend needs its own copy and
    none can be handed a feature it would silently ignore.
    """
    reasons = backend.capabilities.unclaimed(call) + manual_axes_reasons(manual)(backend)
    if reasons:
        raise UnsupportedError(
            f"backend {backend.name!r} cannot serve {call.describe()}: " + "; ".join(reasons)
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def no_gradient(x: Any, message: str) -> Any:
    """Identity whose gradient raises UnsupportedError(message) when traced."""
    return x


def _no_gradient_fwd(x: Any, message: str) -> tuple[Any, None]:
    return x, None


def _no_gradient_bwd(message: str, _: None, g: Any) -> tuple[Any]:
    raise UnsupportedError(message)


no_gradient.defvjp(_no_gradient_fwd, _no_gradient_bwd)


def guard_gradients(
    backend: Backend, q: Any, k: Any, v: Any, operands: Operands
) -> tuple[Any, Any, Any, Operands]:
    """Make a gradient the backend does not implement fail loudly, never silently."""
    caps = backend.capabilities
    if not caps.differentiable:
        message = f"backend {backend.name!r} is not differentiable (capabilities)"
        q, k, v = (no_gradient(x, message) for x in (q, k, v))
    if operands.bias is not None and not caps.bias_grad:
        message = f"backend {backend.name!r} has no gradient w.r.t. bias (bias_grad=False)"
        operands = operands._replace(bias=no_gradient(operands.bias, message))
    return q, k, v, operands


def forward_only(attend: Callable[..., Any], message: str) -> Callable[..., Any]:
    """``attend(q, k, v, operands)`` whose gradient raises UnsupportedError(message)
    when traced, before JAX differentiates anything inside it (a loop whose
    bounds are values cannot be, and would raise its own error)."""

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, operands: Operands) -> Any:
        return attend(q, k, v, operands)

    def run_fwd(q: Any, k: Any, v: Any, operands: Operands) -> tuple[Any, None]:
        return attend(q, k, v, operands), None

    def run_bwd(_: None, g: Any) -> Any:
        raise UnsupportedError(message)

    run.defvjp(run_fwd, run_bwd)
    return run


def single_device_only(call: AttentionCall) -> str | None:
    """Why ``call`` is served on a single device only, not sharded or by ring
    attention (the refusal's message); None when it is not."""
    if "dropout" in call.features:
        # Each device would draw its shard's mask from the same key and
        # local positions: masks repeated across shards, not the contract's.
        return (f"dropout_rate={call.dropout_rate}: attention dropout is served on a "
                "single device only, not for sharded or ring attention; apply "
                "dropout outside attention there, or call it unsharded")
    if call.kv_dtype is not None:
        return (f"k, v: attention over a quantized K and V ({call.kv_dtype}) is served on a "
                "single device only, not for sharded or ring attention; call it unsharded "
                "(or per device, inside your own jax.shard_map)")
    return None


def lengths_in_range(call: AttentionCall, operands: Operands) -> Operands:
    """``q_lengths`` clipped to ``[0, Tq]`` and ``kv_lengths`` to ``[0, Tk]``.

    The same answer by the contract (``j < kv_lengths[b]`` over ``0 <= j < Tk``
    holds for every j once the length reaches Tk, for none below 0), so a
    length past the sequence means the whole sequence, a negative one nothing;
    and no backend is ever handed a length that could index past its arrays.
    """
    q_lengths, kv_lengths = operands.q_lengths, operands.kv_lengths
    if q_lengths is not None:
        q_lengths = jnp.clip(q_lengths, 0, call.q_len)
    if kv_lengths is not None:
        kv_lengths = jnp.clip(kv_lengths, 0, call.kv_len)
    return operands._replace(q_lengths=q_lengths, kv_lengths=kv_lengths)


def empty_result(call: AttentionCall, q: Any) -> Any:
    """The defined result of a call with B, Tq or Tk equal to 0: zeros, lse -inf.

    out ``[B, Tq, Hq, Dv]`` zeros in q's dtype; lse ``[B, Hq, Tq]`` of -inf
    (``call.accumulation_dtype``).
    """
    out = jnp.zeros((call.batch, call.q_len, call.q_heads, call.v_head_dim), q.dtype)
    if call.return_lse:
        lse = jnp.full((call.batch, call.q_heads, call.q_len), -jnp.inf, call.accumulation_dtype)
        return out, lse
    return out
