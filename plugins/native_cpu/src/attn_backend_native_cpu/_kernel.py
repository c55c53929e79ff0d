"""The dense call through the FFI: ``jax.ffi.ffi_call`` of the two handlers inside
a ``jax.custom_vjp`` (the backward handler recomputes the probabilities from the
forward's saved lse, FlashAttention-2 style)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from attn_backends import AttentionCall, Operands, UnsupportedError
from attn_backends.authoring import jax_api, vary_like
from jax.sharding import NamedSharding, PartitionSpec

from ._library import TARGETS, load_error


def _attributes(call: AttentionCall, operands: Operands, threads: int) -> tuple:
    """The handlers' attributes, as a hashable tuple of (name, numpy scalar)."""
    left, right = call.window or (None, None)
    has_lengths = (operands.q_lengths is not None) | ((operands.kv_lengths is not None) << 1)
    return (
        ("scale", np.float32(call.scale)),
        ("softcap", np.float32(call.softcap or 0.0)),
        ("causal", np.int64(call.causal)),
        ("window_left", np.int64(-1 if left is None else left)),
        ("window_right", np.int64(-1 if right is None else right)),
        ("has_lengths", np.int64(has_lengths)),
        ("threads", np.int64(threads)),
    )


def ffi_results(like: Any, *shapes: tuple[tuple[int, ...], Any]) -> tuple[Any, ...]:
    """A handler's result types, one per (shape, dtype) of ``shapes``: inside a
    user's ``jax.shard_map`` they vary over the manual axes ``like`` varies over
    (``ffi_call`` types them invariant otherwise, and the gradient of an output
    typed invariant is summed over the devices), elsewhere plain."""
    aval = jax_api.aval_of(like)
    if aval.manual_axis_type.varying:  # on the enclosing (manual) mesh, replicated
        mesh = aval.sharding.mesh
        return tuple(jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type,
                                          sharding=NamedSharding(mesh, PartitionSpec()))
                     for shape, dtype in shapes)
    return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes)


def _forward_call(attrs: tuple, q: Any, k: Any, v: Any, q_lengths: Any, kv_lengths: Any):
    b, tq, hq, _ = q.shape
    q, k, v, q_lengths, kv_lengths = vary_like((q, k, v, q_lengths, kv_lengths), q, k, v)
    shapes = ffi_results(q, ((b, tq, hq, v.shape[-1]), q.dtype), ((b, hq, tq), jnp.float32))
    run = jax_api.ffi_call(TARGETS["forward"][1], shapes, vmap_method="sequential")
    return run(q, k, v, q_lengths, kv_lengths, **dict(attrs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(attrs: tuple, q: Any, k: Any, v: Any, q_lengths: Any, kv_lengths: Any):
    return _forward_call(attrs, q, k, v, q_lengths, kv_lengths)


def _attention_fwd(attrs, q, k, v, q_lengths, kv_lengths):
    out, lse = _forward_call(attrs, q, k, v, q_lengths, kv_lengths)
    return (out, lse), (q, k, v, out, lse, q_lengths, kv_lengths)


def _attention_bwd(attrs, residuals, cotangents):
    q, k, v, out, lse, q_lengths, kv_lengths = residuals
    d_out, d_lse = vary_like(cotangents, q)
    shapes = ffi_results(q, *((x.shape, x.dtype) for x in (q, k, v)))
    run = jax_api.ffi_call(TARGETS["backward"][1], shapes, vmap_method="sequential")
    dq, dk, dv = run(q, k, v, out, lse, d_out.astype(q.dtype), d_lse.astype(jnp.float32),
                     q_lengths, kv_lengths, **dict(attrs))
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _lengths(x: Any, batch: int) -> Any:
    """int32 ``[B]`` lengths, or zeros the handler ignores (has_lengths says which)."""
    return jnp.zeros((batch,), jnp.int32) if x is None else jnp.asarray(x).astype(jnp.int32)


def native_attention(call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
                     threads: int) -> tuple[Any, Any]:
    """q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` -> out
    ``[B, Tq, Hq, Dv]`` (q's dtype) and lse ``[B, Hq, Tq]`` float32.

    Differentiable in q, k, v (and through lse); the call's causal, window,
    lengths and softcap become the handlers' attributes and length operands.
    """
    reason = load_error()  # registers the targets at the first call
    if reason is not None:
        raise UnsupportedError(f"native_cpu cannot run: {reason}")
    attrs = _attributes(call, operands, threads)
    return _attention(attrs, q, k, v, _lengths(operands.q_lengths, call.batch),
                      _lengths(operands.kv_lengths, call.batch))
