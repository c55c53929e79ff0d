"""The quantizer of a quantized paged cache, checked on its own (the ``quantized``
family's ``store`` cases; docs/DESIGN.md, "Quantized caches").

``write`` (jitted, the cache donated) is given tokens of random K and V and,
among them, the rows the rule names: a row of zeros, a row whose largest
element is exact, a head holding a NaN and one holding +Inf beside a finite
head of the same token, and padding tokens of NaN and Inf at negative slots.
The canonical view after it must hold, per written (position, kv head): the
scale ``max|x| / largest`` (to float32 rounding), values in range (int8 never
-128), every element within half a step of its scale (int8: ``scale / 2``;
float8: half the format's spacing at the value, times the scale); zeros as
scale 0 and values 0; a non-finite head as scale NaN and values 0, its
neighbour head untouched by it; every other slot, values and scales, bitwise
as before (a NaN as any NaN); no padding token anywhere.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from attn_backends.authoring import LARGEST
from attn_backends.oracle import dequantize_rows
from attn_backends.probe.paged_inputs import half_step


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: equal values, NaN equal to NaN (any payload)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _special_rows(k: np.ndarray) -> np.ndarray:
    """``k`` ``[T, Hkv, D]`` with token 0 all zeros, token 1's head 0 holding an
    exact peak, token 2's head 0 a NaN and token 3's head 0 a +Inf (their other
    heads finite)."""
    k = k.copy()
    k[0] = 0.0
    k[1, 0, 0] = -2.0 * np.max(np.abs(k[1, 0]))
    k[2, 0, 1] = np.nan
    k[3, 0, 2] = np.inf
    return k


def check_quantized_write(paged: Any, batch: Any, case_id: str) -> None:
    """Assert the quantizer's rule on ``paged.write`` over ``batch``'s pool (a
    quantized case with garbage in its unused slots)."""
    kv_dtype = paged.call.kv_dtype
    largest = LARGEST[kv_dtype]
    hkv, d = paged.call.kv_heads, paged.call.head_dim
    assert batch.slots.size >= 4, f"{case_id}: the store case needs 4 tokens"
    pad = np.array([-1, -2, -(2**30)], np.int32)
    slots = np.concatenate([batch.slots, pad])
    rows = {"K": _special_rows(batch.k_rows), "V": _special_rows(batch.v_rows)}
    tokens = {name: np.concatenate([x, np.full((3, hkv, d), fill, np.float32)])
              for (name, x), fill in zip(rows.items(), (np.nan, np.inf), strict=True)}
    before = [np.array(x) for x in batch.canonical()]
    # Garbage where the tokens go (int8 holds no NaN: its largest value), so a
    # token write never stores is seen: the pool held the suite's own copy there.
    for x in before:
        flat = x.reshape(-1, *x.shape[2:])
        flat[batch.slots] = 127 if x.dtype.kind == "i" else np.nan
    cache = paged.from_canonical(*(jnp.asarray(x) for x in before))
    dtype = jnp.dtype(paged.call.dtype)
    cache = jax.jit(paged.write, donate_argnums=0)(
        cache, jnp.asarray(tokens["K"], dtype), jnp.asarray(tokens["V"], dtype),
        jnp.asarray(slots))
    after = [np.asarray(x) for x in paged.to_canonical(cache)]
    flat = before[0].shape[0] * before[0].shape[1]
    rest = np.setdiff1d(np.arange(flat), batch.slots)
    for i, name in enumerate(("K", "V")):
        values = after[i].reshape(flat, hkv, d)
        scales = after[i + 2].reshape(flat, hkv)
        old_values = before[i].reshape(flat, hkv, d)
        old_scales = before[i + 2].reshape(flat, hkv)
        what = f"{case_id}: write's {name}"
        # Rows rounded to the call's dtype, as write receives them.
        x = np.asarray(jnp.asarray(rows[name], dtype)).astype(np.float64)
        got_v = values[batch.slots].astype(np.float64)
        got_s = scales[batch.slots].astype(np.float64)
        finite = np.isfinite(x).all(-1)
        peak = np.where(finite, np.abs(np.where(np.isfinite(x), x, 0)).max(-1), np.nan)
        want_s = peak / largest
        ok = np.isclose(got_s, want_s, rtol=2e-7, atol=0) | (np.isnan(got_s) & ~finite)
        assert ok.all(), (f"{what}: scales should be max|x| / {largest:g} per position and kv "
                          f"head; token {int(np.argwhere(~ok)[0][0])} head "
                          f"{int(np.argwhere(~ok)[0][1])} has {got_s[~ok][0]!r}, expected "
                          f"{want_s[~ok][0]!r} (a non-finite head: NaN)")
        assert not got_v[~finite].any(), (
            f"{what}: a (position, head) holding NaN or Inf must store values 0 (scale NaN)")
        if kv_dtype == "int8":
            assert got_v.min() >= -127 and got_v.max() <= 127, (
                f"{what}: int8 values must lie in [-127, 127], got [{got_v.min():g}, "
                f"{got_v.max():g}]")
        err = np.abs(dequantize_rows(got_v, got_s) - x)[finite]
        bound = (half_step(values[batch.slots], kv_dtype) * got_s[..., None])[finite]
        # The division x / scale is rounded to float32 before values are rounded.
        slack = 1e-6 * np.abs(x[finite]) + 1e-30
        worst = np.max((err - bound - slack) / np.maximum(bound, 1e-30))
        assert np.all(err <= bound + slack), (
            f"{what}: an element is more than half a step from its stored value times its "
            f"scale (worst by {worst:.3g} steps)")
        assert got_v[1, 0, 0] == -largest, (
            f"{what}: the element at a head's peak must store -{largest:g} (its largest "
            f"value), got {got_v[1, 0, 0]:g}")
        assert got_s[0].max() == 0 and not got_v[0].any(), (
            f"{what}: a row of zeros must store scale 0 and values 0, got scales "
            f"{got_s[0].tolist()}")
        assert np.isnan(got_s[2, 0]) and np.isfinite(got_s[2, 1:]).all(), (
            f"{what}: token 2's head 0 holds a NaN: its scale is NaN, its other heads' are "
            f"finite; got {got_s[2].tolist()}")
        # Values compare as numbers, NaN equal to NaN: XLA's scatter on cpu may
        # rewrite a float8 NaN's payload bits (float8_e5m2 has several).
        same = np.all(_same(values[rest], old_values[rest]), axis=(1, 2))
        same &= np.all(_same(scales[rest], old_scales[rest]), axis=1)
        touched = rest[~same]
        assert not touched.size, (
            f"{what}: values or scales changed at slots {touched[:5].tolist()}, which no token "
            "names (a padding token, slot < 0, written?)")
