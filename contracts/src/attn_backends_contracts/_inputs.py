"""The arrays of a case: deterministic in its family and name.

Kept apart from the case tables (``cases``, which hold data and the rules
that pick cases for a manifest, and re-export :func:`make_inputs`). Both take
:class:`Case` from :mod:`._case`; this module imports nothing of ``cases``.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import numpy as np
from attn_backends.authoring import CLAIMABLE_DTYPES, DTYPES

from ._case import GARBAGE, Case


def _rng(case: Case, salt: str = "") -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"{case.family}/{case.name}/{salt}".encode()))


#: Dtypes a manifest may claim beyond the default ones: float64, which JAX
#: computes only under x64.
WIDE_DTYPES = CLAIMABLE_DTYPES - DTYPES


def wide(dtype: str) -> bool:
    """Whether ``dtype`` is one JAX computes only under x64 (float64)."""
    return dtype in WIDE_DTYPES


def x64_for(dtype: str) -> contextlib.AbstractContextManager[Any]:
    """``jax.enable_x64(True)`` for a float64 case (without it JAX computes
    float32), else a context that changes nothing: a case's program is traced,
    compiled and run inside it."""
    import jax

    return jax.enable_x64(True) if wide(dtype) else contextlib.nullcontext()


def _cast(x: np.ndarray, dtype: str) -> tuple[Any, np.ndarray]:
    """``x`` in ``dtype`` (numpy, via ml_dtypes for bfloat16) and its float64 value.

    float64 keeps all of x's bits (no float32 step), so a backend that drops
    to float32 inside shows against the oracle."""
    import jax.numpy as jnp

    typed = np.asarray(x, dtype=np.float64 if wide(dtype) else np.float32)
    typed = typed.astype(jnp.dtype(dtype))
    return typed, typed.astype(np.float64)


def _segments(rng: np.random.Generator, b: int, tq: int, tk: int, kind: str) -> tuple:
    if kind == "disjoint":
        q_ids = np.zeros((b, tq), np.int32)
        q_ids[:, : tq // 2] = 7  # no key has id 7: these rows see nothing
        return q_ids, np.zeros((b, tk), np.int32)
    q_ids, kv_ids = np.zeros((b, tq), np.int32), np.zeros((b, tk), np.int32)
    for i in range(b):
        n_seg = int(rng.integers(2, 4))
        cuts = np.sort(rng.uniform(0.1, 0.9, n_seg - 1))
        q_ids[i] = np.searchsorted(cuts, (np.arange(tq) + 0.5) / tq)
        kv_ids[i] = np.searchsorted(cuts, (np.arange(tk) + 0.5) / tk)
    return q_ids, kv_ids


def _pair_shape(kind: str, b: int, h: int, tq: int, tk: int) -> tuple[int, int, int, int]:
    return {
        "full": (b, h, tq, tk), "empty_rows": (b, h, tq, tk), "shared": (1, 1, tq, tk),
        "per_batch": (b, 1, tq, tk), "per_head": (1, h, tq, tk),
        "key": (b, 1, 1, tk), "key_empty": (b, 1, 1, tk), "key_shared": (1, 1, 1, tk),
    }[kind]


def make_inputs(case: Case) -> dict[str, Any]:
    """Arrays of ``case``; deterministic in its family and name.

    Keys: q, k, v (numpy, case dtype; k and v in ``case.kv_dtype`` when
    quantized, their scales in kwargs) and q64, k64, v64 (their float64
    values, K and V dequantized); kwargs (attention keyword arguments, numpy operands); d_out
    (cotangent, case dtype) and d_out64; d_lse (``[B, Hq, Tq]``, float32, or
    float64 for a float64 case: lse's dtype).
    """
    rng = _rng(case)
    b, tq, tk, hq, hkv = case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads
    d, dv = case.head_dim or 16, case.v_head_dim or case.head_dim or 16
    q = rng.standard_normal((b, tq, hq, d))
    k = rng.standard_normal((b, tk, hkv, d))
    v = rng.standard_normal((b, tk, hkv, dv))
    if case.inputs == "large":
        q, k = q * 1e3, k * 1e3
    elif case.inputs == "positive":
        # Same-sign inputs (a peer's test, tokamax's): every logit large and
        # positive, weights spread over many keys, outputs and dv far from 0.
        q, k, v = (rng.uniform(1.0, 2.0, x.shape) for x in (q, k, v))
    elif case.inputs == "equal":
        k = np.broadcast_to(k[:, :1], k.shape).copy()
    elif case.inputs == "garbage" and case.kv_lengths is not None:
        for i, n in enumerate(case.kv_lengths):
            k[i, n:], v[i, n:] = GARBAGE, -GARBAGE
    kwargs: dict[str, Any] = {
        "scale": case.scale, "causal": case.causal, "window": case.window,
        "softcap": case.softcap,
    }
    if case.segments is not None:
        kwargs["segment_ids"] = _segments(rng, b, tq, tk, case.segments)
    if case.q_lengths is not None:
        kwargs["q_lengths"] = np.asarray(case.q_lengths, np.int32)
    if case.kv_lengths is not None:
        kwargs["kv_lengths"] = np.asarray(case.kv_lengths, np.int32)
    if case.mask is not None:
        mask = rng.uniform(size=_pair_shape(case.mask, b, hq, tq, tk)) < 0.75
        if case.mask == "empty_rows":
            mask[:, :, ::3] = False
        if case.mask == "key_empty":
            mask[min(1, b - 1)] = False  # an example that sees no key at all
        kwargs["mask"] = mask
    if case.bias is not None:
        bias = rng.standard_normal(_pair_shape(case.bias, b, hq, tq, tk))
        kwargs["bias"] = _cast(bias, case.bias_dtype or case.dtype)[0]
    if case.dropout_rate:
        # A raw key (jax.random.PRNGKey's layout), from the case's name.
        kwargs["dropout_rate"] = case.dropout_rate
        kwargs["dropout_key"] = np.array([0, zlib.crc32(case.name.encode())], np.uint32)
    (q, q64), (k, k64), (v, v64) = (_cast(x, case.dtype) for x in (q, k, v))
    if case.kv_dtype is not None:  # by the contract's rule; the oracle reads value * scale
        from attn_backends.oracle import dequantize_rows, quantize_rows

        (k, kwargs["k_scales"]), (v, kwargs["v_scales"]) = (
            quantize_rows(x, case.kv_dtype) for x in (k64, v64))
        k64, v64 = (dequantize_rows(x, kwargs[f"{n}_scales"]) for n, x in (("k", k), ("v", v)))
    d_out, d_out64 = _cast(rng.standard_normal((b, tq, hq, dv)), case.dtype)
    d_lse = (0.5 * rng.standard_normal((b, hq, tq))).astype(
        np.float64 if wide(case.dtype) else np.float32)
    return {
        "q": q, "k": k, "v": v, "q64": q64, "k64": k64, "v64": v64, "kwargs": kwargs,
        "d_out": d_out, "d_out64": d_out64, "d_lse": d_lse,
    }
