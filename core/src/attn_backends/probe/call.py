"""The canonical call a probe runs for a caller's call, and its random inputs.

A verdict is about the canonical call, never about the caller's exact
shapes: every call that maps to the same canonical call shares one verdict.
The mapping keeps each shape class that can change a kernel's answer:

- lengths up to ``SHORT`` are kept exactly (decode steps, Tq or Tk of 1,
  and the short-sequence plans kernels switch to); longer ones become
  ``LONG_Q`` or ``LONG_KV`` while keeping whether Tq <, ==, > Tk;
- the GQA group (query heads per kv head) exactly, with two kv heads (one
  when the call has one), so a wrong head map shows;
- window sides up to ``WINDOW_CAP`` exactly, longer ones as ``WINDOW_CAP``
  (a window that still cuts the probe's rows);
- dtype, head dims, scale, softcap, bias dtype, the mask and bias broadcast
  pattern (a key mask ``[B|1, 1, 1, Tk]`` stays one), every flag; batch at
  most 2, and exactly 2 when the call has lengths (one row one short of
  full, so the diagonal and window still cut it and an off-by-one length
  shows; the other from the upper half).

The backend's options (block sizes) are part of the verdict key too
(:mod:`.prober`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..contract.call import AttentionCall, Operands

#: Lengths up to this are probed as they are.
SHORT = 16
#: Canonical lengths of long sequences: not multiples of any power of two
#: above 1, so a kernel's last tile is partial; several tiles of a backend's
#: small-tile options, and cheap for the dense float64 oracle.
LONG_Q, LONG_KV = 77, 77
#: Canonical lengths when Tq and Tk are both long but differ (cross-attention
#: and chunked prefill, where causal is offset by Tk - Tq).
SHORTER = 45
#: Longer window sides are probed as this (still cutting the probe's rows).
WINDOW_CAP = 24
#: Multipliers tried, in order, when a backend's check() rejects the canonical
#: lengths (kernels with block-size minimums).
SCALE_UPS = (1, 2, 4, 8)


def _lengths(tq: int, tk: int) -> tuple[int, int]:
    if tq <= SHORT or tk <= SHORT:
        return (tq if tq <= SHORT else LONG_Q), (tk if tk <= SHORT else LONG_KV)
    if tq == tk:
        return LONG_Q, LONG_KV
    return (SHORTER, LONG_KV) if tq < tk else (LONG_Q, SHORTER)


def _window(window: tuple[int | None, int | None] | None) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    return tuple(None if s is None else min(s, WINDOW_CAP) for s in window)  # type: ignore[return-value]


def canonical(call: AttentionCall, scale_up: int = 1) -> AttentionCall:
    """The call a probe runs for ``call`` (long lengths times ``scale_up``)."""
    tq, tk = _lengths(call.q_len, call.kv_len)
    if scale_up > 1:
        tq = tq * scale_up if call.q_len > SHORT else tq
        tk = tk * scale_up if call.kv_len > SHORT else tk
    # Two rows when lengths are given: :func:`inputs` needs one of each kind.
    batch = 2 if call.q_lengths or call.kv_lengths else min(call.batch, 2)
    kv_heads = min(call.kv_heads, 2)
    q_heads = call.group * kv_heads

    def pairwise(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        rows = 1 if call.key_mask and shape == call.mask_shape else tq  # a key mask stays one
        return (1 if shape[0] == 1 else batch, 1 if shape[1] == 1 else q_heads, rows, tk)

    return dataclasses.replace(
        call,
        batch=batch,
        q_len=tq,
        kv_len=tk,
        q_heads=q_heads,
        kv_heads=kv_heads,
        window=_window(call.window),
        mask_shape=None if call.mask_shape is None else pairwise(call.mask_shape),
        bias_shape=None if call.bias_shape is None else pairwise(call.bias_shape),
    )


def _segments(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Two contiguous segments per row, each of at least a third of ``length``."""
    ids = np.zeros((batch, length), np.int32)
    if length >= 3:
        for b in range(batch):
            ids[b, rng.integers(length // 3, length - length // 3 + 1):] = 1
    return ids


def _lengths_of_rows(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Row 0 one short of ``length``, the others from its upper half.

    Row 0 keeps the causal diagonal and the window inside the visible keys
    (a length drawn from the upper half of a long Tk often lies left of a
    short Tq's diagonal, hiding a causal bug) and shows an off-by-one length
    even when ``length`` is 1 (then it is 0: a row that sees nothing).
    """
    rows = rng.integers((length + 1) // 2, length + 1, (batch,))
    rows[0] = length - 1
    return rows.astype(np.int32)


def inputs(call: AttentionCall, seed: int = 0) -> dict[str, Any]:
    """Random NumPy inputs for ``call``: ``q, k, v, d_out, d_lse`` and the operands.

    q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``, d_out
    like the output, d_lse ``[B, Hq, Tq]`` (None unless the call returns
    lse); a dropout call's operands hold a raw ``uint32[2]`` ``dropout_key``, a
    quantized one's (``call.kv_dtype``) k and v values and their float32
    ``k_scales``, ``v_scales`` ``[B, Tk, Hkv]``.
    Floating arrays are already rounded to the call's dtype, so the float64
    oracle sees exactly what the backend sees. Rows see several keys
    wherever the call's shape allows: lengths are long (:func:`_lengths_of_rows`),
    segments are long, masks keep most keys.
    """
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy (a jax dependency)

    rng = np.random.default_rng(seed)
    b, tq, tk = call.batch, call.q_len, call.kv_len

    def normal(*shape: int, dtype: str = call.dtype) -> np.ndarray:
        return rng.normal(size=shape).astype(dtype)

    arrays: dict[str, Any] = {
        "q": normal(b, tq, call.q_heads, call.head_dim),
        "k": normal(b, tk, call.kv_heads, call.head_dim),
        "v": normal(b, tk, call.kv_heads, call.v_head_dim),
        "d_out": normal(b, tq, call.q_heads, call.v_head_dim),
        "d_lse": (
            rng.normal(size=(b, call.q_heads, tq)).astype(call.accumulation_dtype)
            if call.return_lse else None
        ),
    }
    ops: dict[str, Any] = {}
    if call.segment_ids:
        ops["segment_ids"] = (_segments(rng, b, tq), _segments(rng, b, tk))
    if call.q_lengths:
        ops["q_lengths"] = _lengths_of_rows(rng, b, tq)
    if call.kv_lengths:
        ops["kv_lengths"] = _lengths_of_rows(rng, b, tk)
    if call.mask_shape is not None:
        ops["mask"] = rng.random(call.mask_shape) < 0.8
    if call.bias_shape is not None:
        ops["bias"] = normal(*call.bias_shape, dtype=call.bias_dtype or "float32")
    if call.dropout_rate:
        # A raw key (jax.random.PRNGKey's layout), so the inputs stay NumPy.
        ops["dropout_key"] = np.array([0, seed + 1], np.uint32)
    if call.kv_dtype is not None:  # quantized K and V: values and scales, the contract's rule
        from .paged_inputs import quantize_rows

        for name in ("k", "v"):
            arrays[name], ops[f"{name}_scales"] = quantize_rows(arrays[name], call.kv_dtype)
    arrays["operands"] = ops
    return arrays


def operands(ops: dict[str, Any]) -> Operands:
    """The :class:`Operands` of :func:`inputs`' operands, as JAX arrays."""
    import jax.numpy as jnp

    out = Operands()
    if "segment_ids" in ops:
        q_ids, kv_ids = ops["segment_ids"]
        out = out._replace(q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
    for name in ("q_lengths", "kv_lengths", "mask", "bias", "dropout_key", "k_scales",
                 "v_scales"):
        if name in ops:
            out = out._replace(**{name: jnp.asarray(ops[name])})
    return out
