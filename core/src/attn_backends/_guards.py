"""Loud failures for gradients a backend does not implement, and empty calls."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._backend import Backend
from ._contract import AttentionCall, Operands
from ._errors import UnsupportedError


def refuse_unclaimed(backend: Backend, call: AttentionCall) -> None:
    """Raise UnsupportedError when ``call`` uses what ``backend``'s manifest does not claim.

    Core's one home for this rule: every path that hands a call to
    ``backend.attend`` runs it first, so no backend needs its own copy and
    none can be handed a feature it would silently ignore.
    """
    reasons = backend.capabilities.unclaimed(call)
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


def empty_result(call: AttentionCall, q: Any) -> Any:
    """The defined result of a call with B, Tq or Tk equal to 0: zeros, lse -inf.

    out ``[B, Tq, Hq, Dv]`` zeros in q's dtype; lse ``[B, Hq, Tq]`` of -inf.
    """
    out = jnp.zeros((call.batch, call.q_len, call.q_heads, call.v_head_dim), q.dtype)
    if call.return_lse:
        lse = jnp.full((call.batch, call.q_heads, call.q_len), -jnp.inf, jnp.float32)
        return out, lse
    return out
