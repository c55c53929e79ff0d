"""The canonical call a probe runs for a caller's call (its random inputs: :mod:`.run`).

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

from ..contract.call import AttentionCall

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
