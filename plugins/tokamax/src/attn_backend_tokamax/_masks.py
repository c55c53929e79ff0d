"""The contract's visibility rules (docs/DESIGN.md, "Logits and visibility") as
tokamax's arguments, and the rows that see no key.

tokamax aligns ``is_causal`` top-left (``q >= k``) and builds
``local_window_size`` from the *key* positions as if they were the query's
(``api.py``: ``k_start = arange(Tk) - before``, indexed by query row), so both
equal the contract's bottom-right rules only when Tq == Tk; every other
condition is one boolean mask, tokamax's ``mask`` argument. tokamax gives a row
with no visible key the mean of V (its masked logits are ``finfo.min``, not
-inf); the contract says zeros, which :func:`Visibility.rows` lets the adapter
write.
"""

from __future__ import annotations

import dataclasses
from functools import reduce
from typing import Any

from attn_backends.authoring import AttentionCall, Operands


@dataclasses.dataclass(frozen=True)
class Visibility:
    """One call's visibility, split into what tokamax takes natively and the rest.

    ``is_causal``, ``window`` (tokamax's ``local_window_size``), ``q_lengths`` and
    ``kv_lengths`` go to tokamax's own arguments; ``mask`` (bool, broadcastable
    to ``[B, Hq, Tq, Tk]``) is every other condition, or None; ``rows`` (bool
    ``[B|1, Hq|1, Tq, 1]``) is whether each row sees a key, or None when every
    row does.
    """

    is_causal: bool
    window: tuple[int, int] | None
    q_lengths: Any
    kv_lengths: Any
    mask: Any
    rows: Any


def _and(parts: list[Any]) -> Any:
    import jax.numpy as jnp

    return reduce(jnp.logical_and, parts) if parts else None


def visibility(call: AttentionCall, ops: Operands, *, native: bool = True) -> Visibility:
    """The tokamax arguments for ``call``'s visibility.

    ``native=False`` keeps only ``is_causal`` native and puts window and lengths
    into ``mask`` (Mosaic TPU refuses tokamax's ``q_end``/``k_end``/``k_start``,
    which its lengths and window become).
    """
    import jax.numpy as jnp

    i = jnp.arange(call.q_len)[None, None, :, None]
    j = jnp.arange(call.kv_len)[None, None, None, :]
    diag = i + call.offset
    aligned = call.offset == 0
    native_causal = call.causal and aligned
    window = call.window
    native_window = (native and aligned and window is not None
                     and None not in window)
    native_lengths = native
    every: list[Any] = []  # every condition, for `rows`
    rest: list[Any] = []  # what tokamax's own arguments do not carry
    if call.causal:
        every.append(j <= diag)
        if not native_causal:
            rest.append(every[-1])
    if window is not None:
        left, right = window
        sides = [] if left is None else [j >= diag - left]
        sides += [] if right is None else [j <= diag + right]
        every += sides
        if not native_window:
            rest += sides
    if ops.q_segment_ids is not None:
        every.append((ops.q_segment_ids[:, :, None] == ops.kv_segment_ids[:, None, :])[:, None])
        rest.append(every[-1])
    for lengths, positions in ((ops.kv_lengths, j), (ops.q_lengths, i)):
        if lengths is not None:
            every.append(positions < lengths[:, None, None, None])
            if not native_lengths:
                rest.append(every[-1])
    if ops.mask is not None:
        every.append(ops.mask)
        rest.append(ops.mask)
    # Causal alone with Tk >= Tq leaves key 0 visible to every row.
    can_empty = bool(every) and (len(every) > 1 or not call.causal or call.offset < 0)
    rows = _and(every).any(axis=-1, keepdims=True) if can_empty else None
    return Visibility(
        is_causal=native_causal,
        window=tuple(window) if native_window else None,  # type: ignore[arg-type]
        q_lengths=ops.q_lengths if native_lengths else None,
        kv_lengths=ops.kv_lengths if native_lengths else None,
        mask=_and(rest),
        rows=rows,
    )


def padded(mask: Any, call: AttentionCall, q_len: int, kv_len: int) -> Any:
    """``mask`` (or all-visible when None) for ``call`` grown to ``[., ., q_len,
    kv_len]``, the padded rows and keys invisible."""
    import jax.numpy as jnp

    if mask is None:
        mask = jnp.ones((1, 1, call.q_len, call.kv_len), bool)
    mask = jnp.broadcast_to(mask, (*mask.shape[:2], call.q_len, call.kv_len))
    return jnp.pad(mask, ((0, 0), (0, 0), (0, q_len - call.q_len), (0, kv_len - call.kv_len)))
