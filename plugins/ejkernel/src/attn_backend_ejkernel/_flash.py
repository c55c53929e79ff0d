"""The call into ejkernel's XLA flash attention, and what the adapter adds to meet
the contract (each a finding of plugins/ejkernel/README.md):

- causal and window are aligned top-left in ejkernel (key j visible to query i
  when ``j <= i``), bottom-right in the contract (``j <= i + Tk - Tq``): the
  band is shifted into ejkernel's ``sliding_window``, or given as a mask when
  the shift leaves ejkernel's window (both sides must be >= 0);
- a hidden key gets the logit ``finfo.min``, not -inf, so a row that sees no
  key averages v: such rows are set to zeros here (the contract's answer,
  with zero gradients);
- ejkernel drops a query whose segment id is negative (its padding rule); the
  contract hides keys by equality of ids only: ids reach it renamed to their
  rank among the sequence's ids, so equality holds and none is negative;
- no kv lengths: given as segment ids (0 for a key inside the length, 1
  past it), or, beside segment ids of the call's own, folded into the mask;
- q.k is formed in the inputs' dtype, so float16 logits overflow: float16
  calls run it in float32 (the contract's logits are float32);
- mask and bias must be ``[B, Hq|1, Tq, Tk]`` and ``[B, Hq, Tq, Tk]``
  (its type checks name the dims), so they are broadcast to that;
- importing ejkernel points JAX's persistent compilation cache, for every
  program of the process, at ``~/.cache/ejkernel-cache`` (each ``@ejit``
  sets ``jax_compilation_cache_dir``) and sets two environment variables:
  :func:`kernel` imports it and puts all three back.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from attn_backends import AttentionCall, Operands

from ._options import EjkernelOptions

#: What importing ejkernel changes for the whole process: JAX's settings and
#: environment variables (ejkernel/__init__.py, ejkernel/callib/_ejit.py).
_JAX_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_entry_size_bytes",
                 "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_enable_xla_caches")
_ENVIRONMENT = ("TF_GPU_ALLOCATOR", "CUTE_DSL_ENABLE_TVM_FFI")


@functools.cache
def kernel() -> Callable[..., Any]:
    """ejkernel's XLA flash attention from its kernel registry, imported once, with
    the JAX settings and environment variables its import changes put back."""
    settings = {name: getattr(jax.config, name) for name in _JAX_SETTINGS}
    environment = {name: os.environ.get(name) for name in _ENVIRONMENT}
    try:
        from ejkernel.kernels import kernel_registry

        return kernel_registry.get("flash_attention", platform="xla", backend="any")
    finally:
        for name, value in settings.items():
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def band(call: AttentionCall) -> tuple[int | None, int | None] | None:
    """The range ``[lo, hi]`` of ``j - i`` that causal and window leave visible
    (None: that side open), or None when neither limits it."""
    lo = hi = None
    if call.window is not None:
        left, right = call.window
        lo = None if left is None else call.offset - left
        hi = None if right is None else call.offset + right
    if call.causal:
        hi = call.offset if hi is None else min(hi, call.offset)
    return None if lo is None and hi is None else (lo, hi)


def _in_band(call: AttentionCall, limits: tuple[int | None, int | None]) -> jax.Array:
    """Bool ``[1, 1, Tq, Tk]``: ``lo <= j - i <= hi``."""
    diff = jnp.arange(call.kv_len)[None, :] - jnp.arange(call.q_len)[:, None]
    ok = jnp.ones((call.q_len, call.kv_len), bool)
    lo, hi = limits
    if lo is not None:
        ok &= diff >= lo
    if hi is not None:
        ok &= diff <= hi
    return ok[None, None]


def _kernel_band(call: AttentionCall) -> tuple[bool, tuple[int, int] | None, bool]:
    """How ejkernel applies the band: (causal, sliding_window, as a mask instead)."""
    limits = band(call)
    if limits is None:
        return False, None, False
    lo, hi = limits
    if lo is None and hi == 0:
        return True, None, False
    # ejkernel's window (left, right) keeps -left <= j - i <= right, both >= 0.
    wide = call.q_len + call.kv_len  # wider than any j - i: that side open
    left, right = (wide if lo is None else -lo), (wide if hi is None else hi)
    if left >= 0 and right >= 0:
        return False, (left, right), False
    return False, None, True


def visible(call: AttentionCall, ops: Operands) -> jax.Array:
    """Bool ``[B|1, Hq|1, Tq, Tk]``: the contract's visibility of key j to query i
    (band, kv lengths, segment ids, mask; q lengths aside)."""
    limits = band(call)
    vis = (jnp.ones((1, 1, call.q_len, call.kv_len), bool) if limits is None
           else _in_band(call, limits))
    if ops.kv_lengths is not None:
        vis &= (jnp.arange(call.kv_len)[None, :] < ops.kv_lengths[:, None])[:, None, None]
    if ops.q_segment_ids is not None:
        vis &= (ops.q_segment_ids[:, :, None] == ops.kv_segment_ids[:, None, :])[:, None]
    if ops.mask is not None:
        vis &= ops.mask
    return vis


def _ids(q_ids: Any, kv_ids: Any) -> tuple[jax.Array, jax.Array]:
    """Segment ids renamed to their rank among the sequence's ids (int32 ``[B, Tq]``
    and ``[B, Tk]``): equal ids stay equal, unequal ones unequal, none is negative."""
    both = jnp.concatenate([q_ids, kv_ids], axis=1).astype(jnp.int32)
    ranks = jax.vmap(lambda row: jnp.searchsorted(jnp.sort(row), row, side="left"))(both)
    ranks = ranks.astype(jnp.int32)
    return ranks[:, :q_ids.shape[1]], ranks[:, q_ids.shape[1]:]


def attention(call: AttentionCall, q: Any, k: Any, v: Any, ops: Operands,
              options: EjkernelOptions) -> jax.Array:
    """Contract attention: q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``.

    Returns out ``[B, Tq, Hq, Dv]`` in q's dtype.
    """
    dtype = q.dtype
    if call.dtype == "float16":
        # ejkernel forms q.k in the inputs' dtype: float16 overflows past 65504
        # (inf, then NaN) where the contract's float32 logits do not.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    flash = kernel()
    from ejkernel.ops import FwdParams  # imported by kernel() already

    causal, window, band_as_mask = _kernel_band(call)
    mask = ops.mask
    if band_as_mask:
        mask = _in_band(call, band(call)) if mask is None else mask & _in_band(call, band(call))
    q_ids = kv_ids = None
    if ops.q_segment_ids is not None:
        q_ids, kv_ids = _ids(ops.q_segment_ids, ops.kv_segment_ids)
        if ops.kv_lengths is not None:
            inside = (jnp.arange(call.kv_len)[None, :] < ops.kv_lengths[:, None])[:, None, None]
            mask = inside if mask is None else mask & inside
    elif ops.kv_lengths is not None:
        q_ids = jnp.zeros((call.batch, call.q_len), jnp.int32)
        kv_ids = (jnp.arange(call.kv_len)[None, :] >= ops.kv_lengths[:, None]).astype(jnp.int32)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (call.batch, mask.shape[1], call.q_len, call.kv_len))
    bias = None if ops.bias is None else jnp.broadcast_to(
        ops.bias, (call.batch, call.q_heads, call.q_len, call.kv_len))
    out = flash(
        q, k, v, attention_mask=mask, bias=bias, softmax_scale=call.scale, causal=causal,
        sliding_window=window, logits_soft_cap=call.softcap,
        fwd_params=FwdParams(q_blocksize=options.q_block, kv_blocksize=options.kv_block),
        q_segment_ids=q_ids, kv_segment_ids=kv_ids,
    )
    # Rows that see no key (or lie past q_lengths) are zeros, and so is their
    # gradient: `where` passes none back to the kernel's average of v.
    seen = jnp.any(visible(call, ops), axis=-1)  # [B|1, Hq|1, Tq]
    if ops.q_lengths is not None:
        seen &= (jnp.arange(call.q_len)[None, :] < ops.q_lengths[:, None])[:, None]
    seen = jnp.broadcast_to(seen, (call.batch, call.q_heads, call.q_len))
    out = jnp.where(seen.transpose(0, 2, 1)[..., None], out, jnp.zeros((), out.dtype))
    return out.astype(dtype)
