"""The float64 oracle itself: its VJP against finite differences, its forward
against jax.nn.dot_product_attention where the two share features, and its
handling of fully masked rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.oracle import attention, attention_vjp

RNG = np.random.default_rng(0)


def _qkv(b: int, tq: int, tk: int, hq: int, hkv: int, d: int, dv: int) -> tuple:
    return (RNG.standard_normal((b, tq, hq, d)), RNG.standard_normal((b, tk, hkv, d)),
            RNG.standard_normal((b, tk, hkv, dv)))


# (name, shape (b, tq, tk, hq, hkv, d, dv), kwargs builder)
FD_CASES: list[tuple[str, tuple[int, ...], Any]] = [
    ("plain", (1, 3, 4, 2, 2, 3, 2), lambda s: {}),
    ("gqa-causal", (1, 3, 5, 4, 2, 3, 3), lambda s: {"causal": True}),
    ("window-scale", (1, 4, 4, 2, 1, 3, 2), lambda s: {"window": (1, 0), "scale": 0.7}),
    ("segments-lengths", (2, 4, 4, 2, 2, 2, 2), lambda s: {
        "segment_ids": (np.array([[0, 0, 1, 1], [0, 1, 1, 1]]),
                        np.array([[0, 1, 1, 1], [0, 0, 1, 1]])),
        "kv_lengths": np.array([4, 3]), "q_lengths": np.array([4, 3])}),
    ("mask-bias-softcap", (1, 3, 4, 2, 2, 2, 2), lambda s: {
        "mask": RNG.uniform(size=(1, 2, 3, 4)) < 0.7, "bias": RNG.standard_normal((1, 1, 3, 4)),
        "softcap": 1.5}),
    ("empty-rows", (1, 5, 2, 2, 2, 2, 2), lambda s: {"causal": True}),
]


def _loss(q, k, v, bias, d_out, d_lse, kw) -> float:
    out, lse = attention(q, k, v, bias=bias, **kw)
    finite = np.where(np.isfinite(lse), lse, 0.0)
    return float(np.sum(out * d_out) + np.sum(finite * d_lse))


@pytest.mark.parametrize("name, shape, make", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_vjp_matches_finite_differences(name: str, shape: tuple[int, ...], make: Any) -> None:
    b, tq, tk, hq, hkv, d, dv = shape
    q, k, v = _qkv(b, tq, tk, hq, hkv, d, dv)
    kw = make(shape)
    bias = kw.pop("bias", None)
    d_out = RNG.standard_normal((b, tq, hq, dv))
    d_lse = RNG.standard_normal((b, hq, tq))
    grads = attention_vjp(q, k, v, d_out, d_lse=d_lse, bias=bias, **kw)
    inputs = {"q": q, "k": k, "v": v, "bias": bias}
    eps = 1e-6
    for key, x in inputs.items():
        if x is None:
            assert grads[key] is None
            continue
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            hi, lo = x.copy(), x.copy()
            hi[idx] += eps
            lo[idx] -= eps
            args_hi = {**inputs, key: hi}
            args_lo = {**inputs, key: lo}
            fd[idx] = (
                _loss(args_hi["q"], args_hi["k"], args_hi["v"], args_hi["bias"], d_out, d_lse, kw)
                - _loss(args_lo["q"], args_lo["k"], args_lo["v"], args_lo["bias"], d_out, d_lse, kw)
            ) / (2 * eps)
        np.testing.assert_allclose(grads[key], fd, atol=1e-7, rtol=1e-6, err_msg=f"d{key}")


def test_fully_masked_rows_are_zero_with_zero_gradients() -> None:
    q, k, v = _qkv(1, 5, 2, 2, 2, 3, 3)
    out, lse = attention(q, k, v, causal=True)  # Tq > Tk: the first 3 rows see nothing
    assert np.all(out[:, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))
    grads = attention_vjp(q, k, v, np.ones_like(out), d_lse=np.ones_like(lse), causal=True)
    assert np.all(grads["q"][:, :3] == 0)
    assert all(np.all(np.isfinite(g)) for g in grads.values() if g is not None)


def test_invisible_garbage_does_not_change_the_output() -> None:
    q, k, v = _qkv(1, 3, 6, 2, 2, 3, 3)
    clean = attention(q, k, v, kv_lengths=np.array([4]))
    k[:, 4:], v[:, 4:] = 3e4, -3e4
    dirty = attention(q, k, v, kv_lengths=np.array([4]))
    np.testing.assert_array_equal(clean[0], dirty[0])
    np.testing.assert_array_equal(clean[1], dirty[1])


# (name, shape, oracle kwargs, jax.nn kwargs) — features both implement identically.
JAX_CASES = [
    ("plain", (2, 7, 7, 2, 2, 8), {}, {}),
    ("cross-lengths", (1, 5, 11, 2, 2, 8), {}, {}),
    ("gqa", (1, 6, 6, 4, 2, 8), {}, {}),
    ("mqa", (1, 6, 9, 4, 1, 8), {}, {}),
    ("scale", (1, 6, 6, 2, 2, 8), {"scale": 0.3}, {"scale": 0.3}),
    # jax.nn's is_causal is top-left aligned: equal to ours only when Tq == Tk.
    ("causal-square", (1, 9, 9, 2, 2, 8), {"causal": True}, {"is_causal": True}),
    ("kv-lengths", (2, 6, 9, 2, 2, 8), {"kv_lengths": np.array([9, 4])},
     {"key_value_seq_lengths": jnp.array([9, 4])}),
]


@pytest.mark.parametrize("name, shape, ours, theirs", JAX_CASES, ids=[c[0] for c in JAX_CASES])
def test_forward_matches_jax_nn(
    name: str, shape: tuple[int, ...], ours: dict, theirs: dict
) -> None:
    b, tq, tk, hq, hkv, d = shape
    q, k, v = _qkv(b, tq, tk, hq, hkv, d, d)
    out, _ = attention(q, k, v, **ours)
    with jax.default_matmul_precision("highest"):
        ref = jax.nn.dot_product_attention(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), implementation="xla", **theirs
        )
    np.testing.assert_allclose(out, np.asarray(ref, np.float64), atol=2e-6, rtol=2e-6)


def test_forward_with_bias_and_mask_matches_jax_nn() -> None:
    q, k, v = _qkv(2, 6, 8, 2, 2, 8, 8)
    bias = RNG.standard_normal((2, 1, 6, 8))
    mask = RNG.uniform(size=(1, 2, 6, 8)) < 0.8
    mask[..., 0] = True  # jax.nn gives a fully masked row the mean of v; ours gives 0
    out, _ = attention(q, k, v, bias=bias, mask=mask)
    with jax.default_matmul_precision("highest"):
        ref = jax.nn.dot_product_attention(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), bias=jnp.asarray(bias, jnp.float32),
            mask=jnp.asarray(mask), implementation="xla",
        )
    np.testing.assert_allclose(out, np.asarray(ref, np.float64), atol=2e-6, rtol=2e-6)
