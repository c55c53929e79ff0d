"""Decode calls (a few query rows against a KV cache) through a Pallas TPU kernel of our own.

Splash would pad the one query row of a decode step up to a 128-row block;
``_decode_kernel`` reads each kv head's keys once for all the query heads of
its group and stops at each example's length. It reads the cache ``[B, Tk,
Hkv, D]`` as it lies (viewed as ``[B, Tk, Hkv*D]``): no transpose, pad or copy
of K or V outside the kernel. Until this module had its own kernel it used JAX's
``paged_attention``, which needs pages ``[Hkv, pages, 128, D]``, so every call
transposed all of K and V first (the README has the export's before and after).

What the adapter answers for:

- the kernel widens K and V to float32 and accumulates in float32, so float32
  and bfloat16 calls both come here (the output is rounded to q's dtype once);
- it does not **scale** the logits: q arrives multiplied by ``scale`` in
  float32, so softcap applies to ``scale * q·k`` as the contract says;
- it masks by one length per query row (``row_lengths``: causal and a window's
  right side shorten it; rows past ``q_lengths`` get 0 and give zeros). A
  window's left side and segment ids are not lengths, so those calls stay on
  splash; so do calls with more than ``DECODE_MAX_Q`` rows;
- hidden keys are not zeroed first (splash's path does that): the kernel
  replaces hidden logits and zeroes V rows past the longest length itself, so
  NaN or Inf there never reaches the output;
- no logsumexp out and **no backward**. The kernel is the primal of a
  ``custom_vjp`` whose forward and backward rules are the splash path: a call
  that is only evaluated runs this kernel; a call that is differentiated runs
  splash for both passes. So the backend stays differentiable (its manifest is
  unchanged) and gradients never depend on a kernel that has none.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attn_backends import AttentionCall, Operands

from ._config import LANES

if TYPE_CHECKING:
    from ._decode_kernel import DecodeKernelPlan

#: Calls with at most this many query rows are decode calls. Each row adds G
#: rows to the kernel's matmuls while the cache is read once, so a few rows
#: cost little; past that splash (blocks of 128 rows) serves. 8 covers
#: speculative decoding. Not measured on a TPU.
DECODE_MAX_Q = 8
#: Keys per kernel step on a TPU, and the VMEM one K (or V) buffer may take:
#: K and V are double-buffered, so the blocks take 4x this.
BLOCK_K = 512
BLOCK_BYTES = 1 << 20
#: Keys per step in interpret mode: small, so short test caches span several blocks.
INTERPRET_BLOCK_K = LANES


def declines(call: AttentionCall) -> list[str]:
    """Why ``call`` goes to splash instead of the decode kernel (empty: the kernel serves it)."""
    reasons = []
    if call.q_len > DECODE_MAX_Q:
        reasons.append(f"Tq={call.q_len} > {DECODE_MAX_Q}")
    if call.return_lse:
        reasons.append("return_lse: the kernel returns no logsumexp")
    if call.segment_ids:
        reasons.append("segment_ids: the kernel masks by length only")
    if call.window is not None and call.window[0] is not None:
        reasons.append("window with a left side: the kernel masks a prefix only")
    if call.v_head_dim != call.head_dim or call.head_dim % LANES:
        reasons.append(f"head dims {call.head_dim}/{call.v_head_dim}: need D == Dv, a "
                       f"multiple of {LANES}")
    return reasons


def block_k(call: AttentionCall, interpret: bool) -> int:
    """Keys per grid step: all of Tk when it fits one block, else a multiple of 8.

    Mosaic takes a block dim that equals the array's, or one divisible by 8
    (the K/V block's second-minor dim); Tk need not be a multiple of it.
    """
    itemsize = 2 if call.dtype == "bfloat16" else 4
    row_bytes = call.kv_heads * call.head_dim * itemsize
    block = INTERPRET_BLOCK_K if interpret else BLOCK_K
    block = max(8, min(block, BLOCK_BYTES // row_bytes // 8 * 8))
    return call.kv_len if call.kv_len <= block else block


def row_lengths(call: AttentionCall, operands: Operands) -> Any:
    """int32 ``[B, Tq]``: row i of example b sees keys ``[0, length)``.

    ``kv_lengths`` (or Tk), shortened by causal / a window's right side
    (``j <= i + Tk - Tq + right``); 0 for rows past ``q_lengths``.
    """
    import jax.numpy as jnp

    b, tq, tk = call.batch, call.q_len, call.kv_len
    base = jnp.full((b, 1), tk, jnp.int32)
    if operands.kv_lengths is not None:
        base = jnp.clip(operands.kv_lengths.astype(jnp.int32), 0, tk)[:, None]
    right = call.window[1] if call.window is not None else None
    if call.causal:
        right = 0 if right is None else min(right, 0)
    rows = jnp.arange(tq, dtype=jnp.int32)[None, :]
    lengths = jnp.broadcast_to(base, (b, tq))
    if right is not None:
        lengths = jnp.minimum(lengths, rows + call.offset + right + 1)
    lengths = jnp.maximum(lengths, 0)
    if operands.q_lengths is not None:
        lengths = jnp.where(rows < operands.q_lengths.astype(jnp.int32)[:, None], lengths, 0)
    return lengths


def _decode_one(plan: DecodeKernelPlan, q: Any, k: Any, v: Any, lengths: Any) -> tuple[Any]:
    """q ``[B, Tq, Hq, D]`` float32 (scaled), k/v ``[B, Tk, Hkv, D]``, lengths
    ``[B, Tq]`` -> (out ``[B, Tq, Hq, D]`` float32,).

    Only q and the output change layout here (small); K and V are reshaped by
    merging their two minor dims, which moves no data.
    """
    import jax.numpy as jnp

    from ._decode_kernel import decode_fn

    b, tq, hq, d = q.shape
    hkv, g = plan.kv_heads, plan.group
    # Row i*G + g of kv head h is query row i, head h*G + g.
    q = q.reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tq * g, d)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, plan.rows - tq * g), (0, 0)))
    lengths = lengths.astype(jnp.int32)
    out = decode_fn(plan)(
        q, k.reshape(b, k.shape[1], hkv * d), v.reshape(b, v.shape[1], hkv * d),
        lengths.reshape(b * tq), jnp.max(lengths, axis=1),
    )
    out = out[:, :, : tq * g].reshape(b, hkv, tq, g, d).transpose(0, 2, 1, 3, 4)
    return (out.reshape(b, tq, hq, d),)


@functools.lru_cache(maxsize=64)
def _decode_fn(plan: DecodeKernelPlan) -> Callable[..., tuple[Any]]:
    """The kernel over the batch, vmap folded into it; interpreted on cpu when asked.

    ``lax.platform_dependent`` picks the branch when lowering: with
    ``plan.interpret`` the cpu branch runs the kernel in Pallas' interpreter
    (``interpret=True``) and a TPU lowering still gets the Mosaic kernel.
    """
    import jax

    from ._kernel import _batch_as_leading

    compiled = functools.partial(_decode_one, dataclasses.replace(plan, interpret=False))
    if not plan.interpret:
        return _batch_as_leading(compiled)
    emulated = functools.partial(_decode_one, plan)
    return _batch_as_leading(
        lambda *args: jax.lax.platform_dependent(*args, cpu=emulated, default=compiled)
    )


def kernel_plan(call: AttentionCall, interpret: bool) -> DecodeKernelPlan:
    """The static shape of the decode kernel for ``call``."""
    from ._decode_kernel import DecodeKernelPlan

    return DecodeKernelPlan(
        q_len=call.q_len, group=call.q_heads // call.kv_heads, kv_heads=call.kv_heads,
        head_dim=call.head_dim, block_k=block_k(call, interpret), softcap=call.softcap,
        interpret=interpret,
    )


def run(
    call: AttentionCall,
    q: Any,
    k: Any,
    v: Any,
    operands: Operands,
    splash: Callable[[Any, Any, Any, Operands], Any],
    interpret: bool,
) -> Any:
    """out ``[B, Tq, Hq, D]`` for a call :func:`declines` accepted.

    ``splash(q, k, v, operands)`` is the splash path for the same call: the
    forward and backward rules when the call is differentiated. The operands
    are an argument of the custom VJP, not a closure: its rules may be traced
    later than the function (a call inside ``lax.switch``, such as core's
    platform dispatch, is differentiated from its jaxpr), and a closed-over
    tracer would then leak.
    """
    import jax
    import jax.numpy as jnp

    decode = _decode_fn(kernel_plan(call, interpret))

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, operands: Operands) -> Any:
        # No zeroing of hidden keys here (splash needs it, _sanitize): the
        # kernel replaces hidden logits and zeroes unused V rows itself, and a
        # where over the cache would copy it.
        lengths = row_lengths(call, operands)
        q32 = q.astype(jnp.float32) * jnp.float32(call.scale)
        (out,) = decode(q32, k, v, lengths)
        return out.astype(q.dtype)

    def attend_fwd(q: Any, k: Any, v: Any, operands: Operands) -> tuple[Any, Any]:
        return jax.vjp(lambda q, k, v: splash(q, k, v, operands), q, k, v)

    def attend_bwd(splash_vjp: Any, d_out: Any) -> tuple[Any, ...]:
        return (*splash_vjp(d_out), None)  # integer operands: no cotangent

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, operands)
