"""Decode calls (a few query rows against a KV cache) through JAX's paged-attention kernel.

``jax.experimental.pallas.ops.tpu.paged_attention`` reads each kv head's cache
once for all the query heads of its group and stops at each sequence's length,
where splash pads the one query row up to a 128-row block. A contiguous cache is
a paged cache with an identity page table: the cache ``[B, Tk, Hkv, D]`` becomes
``[Hkv, B * pages, PAGE, D]`` and sequence b owns pages ``b*pages ...``.

What the kernel does that the adapter has to answer for (read from its source
in jax 0.10.2 and 0.12.0.1):

- it rounds K and V to **bfloat16** when it loads them (``_maybe_dequantize``
  casts to bfloat16 when no quantisation scales are given), so only bfloat16
  calls come here; a float32 cache would lose about three digits;
- it keeps the running output in **q's dtype** and re-normalises it after every
  block of keys; with a bfloat16 q (taken as is when the group size is a
  multiple of 8) that rounds the output once per block. q is passed in float32,
  so the accumulator is float32 and the output is rounded once, at the end;
- it does not **scale** the logits: q arrives multiplied by ``scale``, so
  softcap applies to ``scale * q·k`` as the contract says;
- one query row per sequence, masked by a length ``[B]``: the Tq rows of a call
  become Tq sequences sharing one page table, each with its own length
  (causal and a window's right side shorten it; rows past ``q_lengths`` get 0,
  which the kernel returns as zeros without reading a key). Every row reads
  its pages again, which is why only calls with ``Tq <= DECODE_MAX_Q`` come here;
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
from typing import Any

from attn_backends import AttentionCall, Operands

from . import _sanitize
from ._config import LANES

#: Calls with at most this many query rows are decode calls. Each row re-reads
#: its kv head's pages, so past a few rows splash (one read per q block) wins;
#: 8 covers speculative decoding. Not measured on a TPU.
DECODE_MAX_Q = 8
#: Tokens per page, and the most pages one kernel step reads (512 keys).
PAGE = LANES
BLOCK_PAGES = 4


def declines(call: AttentionCall) -> list[str]:
    """Why ``call`` goes to splash instead of the paged kernel (empty: paged serves it)."""
    reasons = []
    if call.q_len > DECODE_MAX_Q:
        reasons.append(f"Tq={call.q_len} > {DECODE_MAX_Q}")
    if call.dtype != "bfloat16":
        reasons.append(f"dtype {call.dtype}: the kernel rounds K and V to bfloat16")
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


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static shape of one paged-kernel instance: padded cache length, block, softcap."""

    kv_len: int
    block_pages: int
    softcap: float | None
    interpret: bool

    @classmethod
    def for_call(cls, call: AttentionCall, interpret: bool) -> DecodePlan:
        pages = -(-call.kv_len // PAGE)
        block = min(BLOCK_PAGES, pages)
        kv_len = -(-pages // block) * block * PAGE
        return cls(kv_len=kv_len, block_pages=block, softcap=call.softcap, interpret=interpret)


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


def _paged_one(plan: DecodePlan, q: Any, k: Any, v: Any, lengths: Any) -> tuple[Any]:
    """q ``[B, Tq, Hq, D]`` float32 (scaled), k/v ``[B, Tk, Hkv, D]``, lengths
    ``[B, Tq]`` -> (out ``[B, Tq, Hq, D]`` float32,)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    b, tq, hq, d = q.shape
    pages = plan.kv_len // PAGE

    def to_pages(x: Any) -> Any:
        x = jnp.pad(x, ((0, 0), (0, plan.kv_len - x.shape[1]), (0, 0), (0, 0)))
        return x.transpose(2, 0, 1, 3).reshape(x.shape[2], b * pages, PAGE, d)

    # Identity page table, one row per query row: row (b, i) reads b's pages.
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, 1, pages)
    table = jnp.broadcast_to(table, (b, tq, pages)).reshape(b * tq, pages)
    out = paged_attention(
        q.reshape(b * tq, hq, d), to_pages(k), to_pages(v), lengths.reshape(b * tq), table,
        pages_per_compute_block=plan.block_pages, attn_logits_soft_cap=plan.softcap,
    )
    return (out.reshape(b, tq, hq, d),)


@functools.lru_cache(maxsize=64)
def _paged_fn(plan: DecodePlan) -> Callable[..., tuple[Any]]:
    """The kernel over the batch, vmap folded into it; emulated on cpu in interpret mode.

    Pallas' TPU interpret mode (``force_tpu_interpret_mode``) is needed here:
    ``paged_attention`` takes no ``interpret`` argument. The switch is read when
    the kernel is traced, so only the cpu branch of ``platform_dependent`` gets
    the emulator; a TPU lowering gets the Mosaic kernel.
    """
    import jax
    from jax.experimental.pallas import tpu as pltpu

    from ._kernel import _batch_as_leading

    compiled = functools.partial(_paged_one, plan)
    if not plan.interpret:
        return _batch_as_leading(compiled)

    def emulated(*args: Any) -> tuple[Any]:
        with pltpu.force_tpu_interpret_mode():
            return compiled(*args)

    return _batch_as_leading(
        lambda *args: jax.lax.platform_dependent(*args, cpu=emulated, default=compiled)
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

    paged = _paged_fn(DecodePlan.for_call(call, interpret))

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, operands: Operands) -> Any:
        lengths = row_lengths(call, operands)
        # Keys no live row sees are zeroed: the kernel masks the tail of its
        # last block additively (``qk + mask_value``), which a huge key defeats.
        k, v = _sanitize.hide_keys(call, k, v, operands)
        q32 = q.astype(jnp.float32) * jnp.float32(call.scale)
        (out,) = paged(q32, k, v, lengths)
        return out.astype(q.dtype)

    def attend_fwd(q: Any, k: Any, v: Any, operands: Operands) -> tuple[Any, Any]:
        return jax.vjp(lambda q, k, v: splash(q, k, v, operands), q, k, v)

    def attend_bwd(splash_vjp: Any, d_out: Any) -> tuple[Any, ...]:
        return (*splash_vjp(d_out), None)  # integer operands: no cotangent

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, operands)
