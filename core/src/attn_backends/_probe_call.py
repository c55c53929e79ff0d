"""The tiny call a probe runs: the real call's features on small random arrays."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ._contract import AttentionCall, Operands

#: Longest sequence a probe uses; the dense reference it is compared with
#: materialises Tq x Tk logits, so probes stay small.
PROBE_MAX_LEN = 64


#: Longer probe lengths tried, in order, when a backend's check() rejects a
#: shorter one (kernels with block-size minimums).
PROBE_LENGTHS = (PROBE_MAX_LEN, 256)


def shrink(call: AttentionCall, max_len: int = PROBE_MAX_LEN) -> AttentionCall:
    """``call`` with B <= 2, one kv head (same GQA group), Tq and Tk <= ``max_len``."""
    tq, tk = min(call.q_len, max_len), min(call.kv_len, max_len)

    def pairwise(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        return (1 if shape[0] == 1 else min(call.batch, 2), 1 if shape[1] == 1 else call.group, tq, tk)

    return dataclasses.replace(
        call,
        batch=min(call.batch, 2),
        q_len=tq,
        kv_len=tk,
        q_heads=call.group,
        kv_heads=1,
        mask_shape=None if call.mask_shape is None else pairwise(call.mask_shape),
        bias_shape=None if call.bias_shape is None else pairwise(call.bias_shape),
    )


def arrays(call: AttentionCall, seed: int = 0) -> tuple[Any, Any, Any, Operands, Any]:
    """Random (q, k, v, operands, d_out) for ``call``, as JAX arrays, every row visible-ish.

    q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``, d_out
    like the output. Optional operands follow the call's features.
    """
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    b, tq, tk = call.batch, call.q_len, call.kv_len

    def normal(*shape: int, dtype: str = call.dtype) -> Any:
        return jnp.asarray(rng.normal(size=shape), dtype)

    q = normal(b, tq, call.q_heads, call.head_dim)
    k = normal(b, tk, call.kv_heads, call.head_dim)
    v = normal(b, tk, call.kv_heads, call.v_head_dim)
    ops = Operands()
    if call.segment_ids:
        ops = ops._replace(
            q_segment_ids=jnp.asarray(np.sort(rng.integers(0, 2, (b, tq))), jnp.int32),
            kv_segment_ids=jnp.asarray(np.sort(rng.integers(0, 2, (b, tk))), jnp.int32),
        )
    if call.q_lengths:
        ops = ops._replace(q_lengths=jnp.asarray(rng.integers(1, tq + 1, (b,)), jnp.int32))
    if call.kv_lengths:
        ops = ops._replace(kv_lengths=jnp.asarray(rng.integers(1, tk + 1, (b,)), jnp.int32))
    if call.mask_shape is not None:
        ops = ops._replace(mask=jnp.asarray(rng.random(call.mask_shape) < 0.8))
    if call.bias_shape is not None:
        ops = ops._replace(bias=normal(*call.bias_shape, dtype=call.bias_dtype or "float32"))
    d_out = normal(b, tq, call.q_heads, call.v_head_dim)
    return q, k, v, ops, d_out
