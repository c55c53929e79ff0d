"""What the adapter zeroes before a kernel runs, so hidden positions cannot leak.

The contract says finite garbage in invisible positions never changes the
result. JAX's splash backward computes ``ds = p * (dp - di)`` over whole
blocks without masking it: a hidden key whose value makes ``dp = do·v`` (or,
with softcap, ``q·k``) overflow gives ``0 * inf = NaN`` in dq and dk even
though its probability is 0. The kernel cannot be changed from here, so the
adapter makes sure such keys hold zeros:

- keys that **no live query** can see (past ``kv_lengths``, outside the band
  of every live row, or carrying a segment id no live row holds) are zeroed
  in k and v; ``where`` also gives them exactly zero gradients, as the oracle;
- **query rows past** ``q_lengths`` are dead rows of the kernel function
  (``_kernel``): zero output, and in the backward a zero q, zero cotangent and
  zero ``di``, so garbage there never reaches the keys' gradients.

A key that is hidden from some rows but visible to others (causal, window,
segment ids) must keep its value; if it is large enough to overflow ``do·v``
in float32, rows that do not see it can still get NaN from the kernel. Only
JAX's kernel can fix that (by masking ds); the README says so.
"""

from __future__ import annotations

from typing import Any

from attn_backends.authoring import AttentionCall, Operands


def live_rows(call: AttentionCall, operands: Operands) -> Any:
    """bool ``[B, Tq]``: rows below ``q_lengths`` (all rows without it)."""
    import jax.numpy as jnp

    rows = jnp.arange(call.q_len, dtype=jnp.int32)[None, :]
    if operands.q_lengths is None:
        return jnp.ones((call.batch, call.q_len), bool)
    return rows < operands.q_lengths.astype(jnp.int32)[:, None]


def _row_count(call: AttentionCall, operands: Operands) -> Any:
    """int32 ``[B]``: how many leading rows are live."""
    import jax.numpy as jnp

    if operands.q_lengths is None:
        return jnp.full((call.batch,), call.q_len, jnp.int32)
    return jnp.clip(operands.q_lengths.astype(jnp.int32), 0, call.q_len)


def live_keys(call: AttentionCall, operands: Operands) -> Any:
    """bool ``[B, Tk]``: keys that at least one live row may see.

    Each condition is necessary for visibility, so a key failing any of them is
    invisible to every live row and may be zeroed. Keys that pass may still be
    hidden from some rows (that is the kernel's mask's job).
    """
    import jax.numpy as jnp

    b, tk = call.batch, call.kv_len
    pos = jnp.arange(tk, dtype=jnp.int32)[None, :]
    live = jnp.ones((b, tk), bool)
    if operands.kv_lengths is not None:
        live &= pos < operands.kv_lengths.astype(jnp.int32)[:, None]
    rows = _row_count(call, operands)[:, None]  # live rows are [0, rows)
    live &= rows > 0
    left, right = call.window if call.window is not None else (None, None)
    if call.causal:
        right = 0 if right is None else min(right, 0)
    # Row i sees keys in [i + offset - left, i + offset + right]; the live rows'
    # union is [offset - left, rows - 1 + offset + right].
    if left is not None:
        live &= pos >= call.offset - left
    if right is not None:
        live &= pos <= rows - 1 + call.offset + right
    if operands.q_segment_ids is not None:
        live &= _ids_present(call, operands, rows)
    return live


def _ids_present(call: AttentionCall, operands: Operands, rows: Any) -> Any:
    """bool ``[B, Tk]``: the key's segment id is held by some live query row."""
    import jax
    import jax.numpy as jnp

    q_ids = operands.q_segment_ids.astype(jnp.int32)
    kv_ids = operands.kv_segment_ids.astype(jnp.int32)
    # Dead rows take row 0's id, so they add no id of their own (a batch entry
    # without live rows is excluded by the caller).
    is_live = jnp.arange(call.q_len, dtype=jnp.int32)[None, :] < rows
    q_ids = jnp.sort(jnp.where(is_live, q_ids, q_ids[:, :1]), axis=1)

    def present(sorted_q: Any, kv: Any) -> Any:
        at = jnp.clip(jnp.searchsorted(sorted_q, kv), 0, call.q_len - 1)
        return sorted_q[at] == kv

    return jax.vmap(present)(q_ids, kv_ids)


def hide_keys(call: AttentionCall, k: Any, v: Any, operands: Operands) -> tuple[Any, Any]:
    """(k, v) with the keys no live row sees set to zero.

    k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``. Nothing is done (no copy)
    for calls that hide no key per example.
    """
    import jax.numpy as jnp

    hides_keys = call.kv_lengths or call.q_lengths or call.segment_ids or call.window is not None
    if hides_keys:
        keys = live_keys(call, operands)[:, :, None, None]
        k = jnp.where(keys, k, jnp.zeros((), k.dtype))
        v = jnp.where(keys, v, jnp.zeros((), v.dtype))
    return k, v
