"""xla_native against the float64 oracle: forward and every gradient.

Small shapes and small blocks (so every case spans several blocks, with
lengths that are not multiples of them) keep the file fast on 2 cores.
"""

from __future__ import annotations

from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_xla_native import BlockConfig, XlaNativeBackend
from attn_backends_contracts._oracle import attention, attention_vjp

BACKEND = XlaNativeBackend()
BLOCKS = BlockConfig(block_q=8, block_kv=8)
# Error bounds relative to the oracle's largest magnitude (out, grads).
TOLERANCE = {"float32": (2e-5, 1e-4), "bfloat16": (2e-2, 3e-2), "float16": (5e-3, 5e-3)}


def _attend(q: Any, k: Any, v: Any, blocks: BlockConfig = BLOCKS, **kw: Any) -> Any:
    call, ops = attn_backends.bind(q, k, v, **kw)
    return BACKEND.attend(call, q, k, v, ops, blocks)


def _make(
    rng: np.random.Generator,
    b: int,
    tq: int,
    tk: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
) -> tuple[np.ndarray, ...]:
    dv = d if dv is None else dv
    q = rng.standard_normal((b, tq, hq, d))
    k = rng.standard_normal((b, tk, hkv, d))
    v = rng.standard_normal((b, tk, hkv, dv))
    do = rng.standard_normal((b, tq, hq, dv))
    return q, k, v, do


def _err(got: Any, want: np.ndarray) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "non-finite values"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def check(
    shape: tuple[int, ...],
    dtype: str = "float32",
    blocks: BlockConfig = BLOCKS,
    seed: int = 0,
    bias_dtype: str | None = None,
    **features: Any,
) -> None:
    """Forward, lse, and grads of q, k, v (and bias) against the oracle.

    ``features`` are attention kwargs; arrays are given as callables of
    (rng, b, tq, tk, hq) so each case builds its own.
    """
    rng = np.random.default_rng(seed)
    b, tq, tk, hq, hkv, d, *dv = shape
    q, k, v, do = _make(rng, b, tq, tk, hq, hkv, d, *dv)
    kw = {n: (f(rng, b, tq, tk, hq) if callable(f) else f) for n, f in features.items()}
    bias = kw.pop("bias", None)
    dtypes = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
    cast = dtypes[dtype]
    # The oracle sees exactly the rounded inputs the kernel sees.
    q, k, v = (np.asarray(jnp.asarray(x, cast)) for x in (q, k, v))
    if bias is not None:
        bias = np.asarray(jnp.asarray(bias, dtypes[bias_dtype or dtype]))
    d_lse = rng.standard_normal((b, hq, tq))

    @jax.jit
    def run(q: Any, k: Any, v: Any, bias: Any, do: Any, d_lse: Any) -> Any:
        def f(q: Any, k: Any, v: Any, bias: Any) -> Any:
            return _attend(q, k, v, blocks, bias=bias, return_lse=True, **kw)

        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return out, lse, vjp((do, d_lse))

    out, lse, grads = run(q, k, v, bias, jnp.asarray(do, cast), jnp.asarray(d_lse, jnp.float32))
    assert out.dtype == q.dtype and out.shape == (b, tq, hq, v.shape[-1])
    assert lse.dtype == jnp.float32 and lse.shape == (b, hq, tq)
    want_out, want_lse = attention(q, k, v, bias=bias, **kw)
    # A row with no visible key has lse -inf: its cotangent cannot matter.
    d_lse = np.where(np.isfinite(want_lse), d_lse, 0.0)
    want = attention_vjp(q, k, v, np.asarray(jnp.asarray(do, cast)), d_lse=d_lse, bias=bias, **kw)
    tol_out, tol_grad = TOLERANCE[dtype]
    assert _err(out, want_out) <= tol_out
    hidden = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), hidden)
    lse_err = np.abs(np.where(hidden, 0, np.asarray(lse) - np.where(hidden, 0, want_lse)))
    assert lse_err.max(initial=0) <= 10 * tol_out * max(
        1.0, np.abs(want_lse[~hidden]).max(initial=1)
    )
    for name, got in zip(("q", "k", "v", "bias"), grads, strict=True):
        if name == "bias" and bias is None:
            assert got is None
            continue
        assert got.shape == want[name].shape and got.dtype == (
            q.dtype if name != "bias" else bias.dtype
        )
        assert _err(got, want[name]) <= tol_grad, name


def _ids(n: int, k: int) -> Any:
    return lambda rng, b, tq, tk, hq: rng.integers(0, k, (b, n if n else tq))


def _segments(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int) -> Any:
    # Sorted ids: packed sequences, the common case; one id missing from kv
    # gives rows with no visible key.
    q_ids = np.sort(rng.integers(0, 4, (b, tq)), axis=1)
    kv_ids = np.sort(rng.integers(0, 3, (b, tk)), axis=1)
    return (q_ids, kv_ids)


def _kv_lengths(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int) -> Any:
    return np.array([0, tk // 2, tk][:b])


def _q_lengths(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int) -> Any:
    return np.array([tq, 3, 0][:b])


def _mask(heads: bool, batch: bool) -> Any:
    def make(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int) -> Any:
        return rng.random((b if batch else 1, hq if heads else 1, tq, tk)) > 0.3

    return make


def _bias(heads: bool, batch: bool) -> Any:
    def make(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int) -> Any:
        return rng.standard_normal((b if batch else 1, hq if heads else 1, tq, tk))

    return make


# (B, Tq, Tk, Hq, Hkv, D[, Dv])
SHAPE = (2, 37, 29, 4, 2, 16)
FEATURES = {
    "plain": {},
    # Dv != D, and a mask broadcast over batch and heads.
    "mha_mask_broadcast": {"mask": _mask(False, False), "_shape": (2, 29, 37, 2, 2, 16, 8)},
    "mqa_window_right_only": {"window": (None, 2), "_shape": (1, 29, 37, 4, 1, 16)},
    "causal_tq_gt_tk": {"causal": True},
    "causal_tq_lt_tk_bias_broadcast_batch": {
        "causal": True,
        "bias": _bias(True, False),
        "_shape": (2, 19, 45, 4, 2, 16),
    },
    "window": {"window": (3, 5)},
    "window_left_causal": {"window": (6, None), "causal": True},
    "segment_ids": {"segment_ids": _segments},
    "kv_lengths": {"kv_lengths": _kv_lengths, "_shape": (3, 21, 30, 4, 2, 16)},
    "q_lengths": {"q_lengths": _q_lengths, "_shape": (3, 21, 30, 4, 2, 16)},
    "mask": {"mask": _mask(True, True)},
    "bias": {"bias": _bias(True, True)},
    "bias_broadcast_heads_scale": {"bias": _bias(False, True), "scale": 0.7},
    "softcap": {"softcap": 1.5},
    "everything": {
        "causal": True,
        "window": (9, None),
        "segment_ids": _segments,
        "kv_lengths": lambda rng, b, tq, tk, hq: np.array([tk - 3, 17]),
        "q_lengths": lambda rng, b, tq, tk, hq: np.array([tq, tq - 5]),
        "mask": _mask(False, True),
        "bias": _bias(True, False),
        "softcap": 3.0,
        "_shape": (2, 23, 41, 4, 2, 16),
    },
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature_float32(name: str) -> None:
    features = dict(FEATURES[name])
    shape = features.pop("_shape", SHAPE)
    check(shape, **features)


@pytest.mark.parametrize(
    "dtype, name, bias_dtype",
    [
        ("bfloat16", "everything", None),
        ("float16", "everything", None),
        # A bias may have its own dtype; its gradient keeps it.
        ("bfloat16", "causal_tq_lt_tk_bias_broadcast_batch", "float32"),
    ],
)
def test_low_precision(dtype: str, name: str, bias_dtype: str | None) -> None:
    features = dict(FEATURES[name])
    shape = features.pop("_shape", SHAPE)
    check(shape, dtype=dtype, bias_dtype=bias_dtype, **features)


@pytest.mark.parametrize(
    "shape, causal",
    [
        ((1, 1, 1, 2, 1, 8), True),  # single query, single key
        ((2, 1, 13, 2, 2, 8), True),  # decode: one query against a cache
        ((1, 13, 1, 2, 2, 8), True),  # Tq > Tk causal: most rows see nothing
        ((1, 31, 17, 3, 1, 8), False),  # primes
    ],
)
def test_odd_lengths(shape: tuple[int, ...], causal: bool) -> None:
    check(shape, causal=causal)


def test_default_blocks_and_uneven_blocks() -> None:
    check((1, 70, 53, 2, 1, 8), blocks=BlockConfig(block_q=16, block_kv=7), causal=True)
    check(
        (1, 45, 45, 2, 2, 8),
        blocks=BlockConfig.default_for(attn_backends.bind(*(jnp.zeros((1, 45, 2, 8)),) * 3)[0]),
        causal=True,
    )


@pytest.mark.parametrize("name", ["everything", "causal_tq_lt_tk_bias_broadcast_batch"])
def test_backward_with_its_own_blocks(name: str) -> None:
    # The backward pass re-blocks q, k, v, bias and masks for its own sizes.
    features = dict(FEATURES[name])
    shape = features.pop("_shape", SHAPE)
    check(shape, blocks=BlockConfig(8, 8, block_q_bwd=16, block_kv_bwd=5), **features)


def test_fully_masked_rows_are_zero_with_zero_grads() -> None:
    rng = np.random.default_rng(1)
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in _make(rng, 2, 12, 10, 2, 1, 8))
    kv_lengths = jnp.array([0, 10])

    @jax.jit
    def run(q: Any, k: Any, v: Any) -> Any:
        def f(q: Any, k: Any, v: Any) -> Any:
            return _attend(q, k, v, kv_lengths=kv_lengths, causal=True, return_lse=True)

        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((do, jnp.ones_like(lse)))

    out, lse, (dq, dk, dv) = run(q, k, v)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(lse[0]))
    # Tq > Tk causal: the first Tq - Tk rows of batch 1 see nothing.
    assert np.all(np.asarray(out[1, :2]) == 0) and np.all(np.isneginf(lse[1, :, :2]))
    assert np.all(np.isfinite(lse[1, :, 2:]))
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g))
    assert np.all(np.asarray(dq[0]) == 0) and np.all(np.asarray(dq[1, :2]) == 0)
    assert np.all(np.asarray(dk[0]) == 0) and np.all(np.asarray(dv[0]) == 0)


def test_garbage_in_hidden_positions_changes_nothing() -> None:
    rng = np.random.default_rng(2)
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in _make(rng, 2, 20, 27, 2, 2, 8))
    kv_lengths = jnp.array([11, 19])
    hidden = jnp.arange(27)[None, :, None, None] >= kv_lengths[:, None, None, None]
    k_bad = jnp.where(hidden, 3e37, k)
    v_bad = jnp.where(hidden, -3e38, v)

    @jax.jit
    def run(k: Any, v: Any) -> Any:
        f = lambda q, k, v: _attend(q, k, v, kv_lengths=kv_lengths, causal=True)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return out, *vjp(do)

    clean, dirty = run(k, v), run(k_bad, v_bad)
    np.testing.assert_array_equal(clean[0], dirty[0])
    np.testing.assert_array_equal(clean[1], dirty[1])  # dq
    for got, want in zip(dirty[2:], clean[2:], strict=True):  # dk, dv: zero where hidden
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(jnp.where(hidden, 0, got), want)


def test_float16_near_the_top_of_its_range() -> None:
    rng = np.random.default_rng(6)
    q, k, v, do = _make(rng, 1, 16, 16, 2, 2, 64)

    def f16(x: np.ndarray, size: float) -> np.ndarray:
        return np.asarray(x * size, np.float16)

    # A scale of 4 folded into a q of about 1e4 would pass float16's 65504.
    q_big, k_small = f16(q, 1e4), f16(k, 1e-3)
    want, _ = attention(q_big, k_small, f16(v, 1), scale=4.0, causal=True)
    got = _attend(q_big, k_small, f16(v, 1), scale=4.0, causal=True)
    assert _err(got, want) < TOLERANCE["float16"][0]
    # Loss-scaled output gradients: logit gradients reach about 1e5 while dq,
    # dk and dv all fit in float16.
    q, k, v, do = f16(q, 0.05), f16(k, 1), f16(v, 100), f16(do, 150)
    want = attention_vjp(q, k, v, do, causal=True)
    _, vjp = jax.vjp(lambda q, k, v: _attend(q, k, v, causal=True), q, k, v)
    for got, key in zip(vjp(jnp.asarray(do)), "qkv", strict=True):
        assert _err(got, want[key]) < TOLERANCE["float16"][1], key


def _garbage_changes_nothing(hidden: np.ndarray, **kw: Any) -> None:
    """Keys at ``hidden`` ([B, Tk]) are visible to no query: huge garbage
    there must leave output and dq bit-for-bit unchanged."""
    rng = np.random.default_rng(1)
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in _make(rng, 2, 20, hidden.shape[1], 2, 2, 8))
    where = jnp.asarray(hidden)[:, :, None, None]

    @jax.jit
    def run(k: Any, v: Any) -> Any:
        out, vjp = jax.vjp(lambda q, k, v: _attend(q, k, v, **kw), q, k, v)
        return out, vjp(do)[0]

    clean, dirty = run(k, v), run(jnp.where(where, 3e37, k), jnp.where(where, -3e37, v))
    np.testing.assert_array_equal(clean[0], dirty[0])
    np.testing.assert_array_equal(clean[1], dirty[1])


def test_garbage_in_a_segment_no_query_has_changes_nothing() -> None:
    q_ids = np.zeros((2, 20), np.int32)
    kv_ids = np.zeros((2, 27), np.int32)
    kv_ids[:, 17:20] = 7  # no query is in segment 7
    _garbage_changes_nothing(kv_ids == 7, segment_ids=(q_ids, kv_ids))


def test_garbage_in_keys_the_mask_hides_from_everyone_changes_nothing() -> None:
    mask = np.ones((2, 1, 20, 27), bool)
    mask[..., 17:20] = False
    mask[1, ..., 25:] = False
    _garbage_changes_nothing(~mask.any(axis=(1, 2)), mask=mask, causal=True)


def test_transforms_jit_vmap_checkpoint() -> None:
    rng = np.random.default_rng(3)
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in _make(rng, 3, 18, 18, 2, 1, 8))
    bias = jnp.asarray(rng.standard_normal((3, 1, 18, 18)), jnp.float32)

    def loss(q: Any, k: Any, v: Any, bias: Any) -> Any:
        return jnp.sum(_attend(q, k, v, causal=True, bias=bias) * do)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))
    want = attention_vjp(q, k, v, do, causal=True, bias=bias)
    for name, a, b in zip(("q", "k", "v", "bias"), grad(q, k, v, bias), remat(q, k, v, bias),
                          strict=True):
        assert _err(a, want[name]) <= 1e-4
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # vmap over a leading axis (each slice a batch of 1), lengths batched too.
    lengths = jnp.array([5, 18, 0])

    def one(q: Any, k: Any, v: Any, n: Any) -> Any:
        return _attend(q[None], k[None], v[None], kv_lengths=n[None])[0]

    mapped = jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(one(*a) * do[0]), argnums=(0, 1, 2))))(
        q, k, v, lengths
    )
    want = attention_vjp(q, k, v, np.broadcast_to(do[:1], do.shape), kv_lengths=lengths)
    for name, got in zip("qkv", mapped, strict=True):
        assert _err(got, want[name]) <= 1e-4
