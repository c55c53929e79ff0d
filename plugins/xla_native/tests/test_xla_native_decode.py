"""xla_native's decode path against the float64 oracle: forward, lse and
every gradient, with small chunks so each sequence spans several chunks
and a short last one."""

from __future__ import annotations

from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_xla_native import XlaNativeBackend
from attn_backend_xla_native._decode import decode_attention
from attn_backend_xla_native._decode_layout import DecodePlan
from attn_backend_xla_native._plan import DECODE_MAX_Q, DECODE_MIN_JAXLIB, _jaxlib_at_least
from attn_backends_contracts._oracle import attention, attention_vjp

CHUNK = 8
TK = 45  # five whole chunks of 8 and a short one of 5
# Error bounds relative to the oracle's largest magnitude (out, grads).
TOLERANCE = {"float32": (2e-5, 1e-4), "bfloat16": (2e-2, 3e-2), "float16": (5e-3, 5e-3)}
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def _err(got: Any, want: np.ndarray) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "non-finite values"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def _inputs(shape: tuple[int, ...], dtype: str, seed: int = 0) -> tuple[np.ndarray, ...]:
    b, tq, tk, hq, hkv, d = shape
    rng = np.random.default_rng(seed)
    arrays = [
        rng.standard_normal(s) for s in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d))
    ]
    # The oracle sees exactly the rounded inputs the kernel sees.
    return tuple(np.asarray(jnp.asarray(x, DTYPES[dtype])) for x in arrays)


def _run(q: Any, k: Any, v: Any, do: Any, d_lse: Any, chunk: int, **kw: Any) -> Any:
    bias = kw.pop("bias", None)

    @jax.jit
    def run(q: Any, k: Any, v: Any, bias: Any) -> Any:
        def f(q: Any, k: Any, v: Any, bias: Any) -> Any:
            call, ops = attn_backends.bind(q, k, v, bias=bias, return_lse=True, **kw)
            return decode_attention(call, q, k, v, ops, chunk)

        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return out, lse, vjp((do, d_lse))

    return run(q, k, v, bias)


def check(
    shape: tuple[int, ...], dtype: str = "float32", chunk: int = CHUNK, **kw: Any
) -> None:
    """Out, lse and the grads of q, k, v (and bias) against the oracle."""
    q, k, v = _inputs(shape, dtype)
    b, tq, _, hq, _, d = shape
    rng = np.random.default_rng(1)
    do = np.asarray(jnp.asarray(rng.standard_normal((b, tq, hq, d)), DTYPES[dtype]))
    d_lse = rng.standard_normal((b, hq, tq)).astype(np.float32)
    out, lse, grads = _run(q, k, v, do, d_lse, chunk, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (b, hq, tq)
    want_out, want_lse = attention(q, k, v, **kw)
    tol_out, tol_grad = TOLERANCE[dtype]
    assert _err(out, want_out) <= tol_out
    hidden = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), hidden)
    lse_err = np.abs(np.where(hidden, 0, np.asarray(lse) - np.where(hidden, 0, want_lse)))
    scale = max(1.0, np.abs(want_lse).max(initial=1, where=~hidden))
    assert lse_err.max(initial=0) <= 10 * tol_out * scale
    d_lse = np.where(hidden, 0.0, d_lse)
    want = attention_vjp(q, k, v, do, d_lse=d_lse, **kw)
    for name, got in zip(("q", "k", "v", "bias"), grads, strict=True):
        if name == "bias" and kw.get("bias") is None:
            assert got is None
            continue
        assert got.shape == want[name].shape
        assert _err(got, want[name]) <= tol_grad, name


# (B, Tq, Tk, Hq, Hkv, D): GQA and MQA, one query and four (speculative decoding).
SHAPES = {
    "gqa_tq1": (3, 1, TK, 4, 2, 16),
    "mqa_tq1": (3, 1, TK, 4, 1, 16),
    "gqa_tq4": (3, 4, TK, 4, 2, 16),
    "mqa_tq4": (3, 4, TK, 2, 1, 16),
}
# Lengths 0 and 1, one inside the short last chunk, and one not a multiple
# of the chunk.
LENGTHS = np.array([0, 1, 19])


# Each dtype meets GQA and MQA, Tq=1 and Tq=4 (all eight cost twice the time).
@pytest.mark.parametrize(
    "name,dtype",
    [
        ("gqa_tq1", "float32"),
        ("mqa_tq4", "float32"),
        ("mqa_tq1", "bfloat16"),
        ("gqa_tq4", "bfloat16"),
    ],
)
def test_cache_with_lengths(name: str, dtype: str) -> None:
    check(SHAPES[name], dtype, causal=True, kv_lengths=LENGTHS)


def test_every_length_reaches_the_last_chunk() -> None:
    check(SHAPES["gqa_tq4"], causal=True, kv_lengths=np.array([TK, 41, 40]))


def test_no_lengths_no_mask_float16() -> None:
    check(SHAPES["gqa_tq1"], "float16")


def test_chunk_longer_than_the_cache() -> None:
    check((2, 4, 5, 4, 2, 16), causal=True, kv_lengths=np.array([5, 1]), chunk=CHUNK)


def _ids(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return np.sort(rng.integers(0, 3, (3, 4)), axis=1), np.sort(rng.integers(0, 3, (3, TK)), 1)


_RNG = np.random.default_rng(7)
FEATURES = {
    "window": {"causal": True, "window": (9, 0), "kv_lengths": np.array([30, 1, 45])},
    "segments": {"segment_ids": _ids(_RNG)},
    "q_lengths": {"causal": True, "q_lengths": np.array([4, 2, 0])},
    "mask_bias_softcap": {
        "mask": _RNG.random((3, 1, 4, TK)) > 0.3,
        "bias": _RNG.standard_normal((1, 4, 4, TK)).astype(np.float32),
        "softcap": 2.0,
        "kv_lengths": np.array([44, 9, 0]),
    },
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_features(name: str) -> None:
    check(SHAPES["gqa_tq4"], **FEATURES[name])


def test_prefixes_halve_in_whole_chunks() -> None:
    call, _ = attn_backends.bind(*_inputs((1, 1, 45, 2, 1, 8), "float32"))
    plan = DecodePlan.of(call, 4)
    assert plan.prefixes(True) == (4, 8, 12, 24, 45)
    assert plan.prefixes(False) == (45,)
    assert plan.segments(45) == ((0, 11, 4), (44, 1, 1))
    assert plan.segments(12) == ((0, 3, 4),)


def _decode_out(v: np.ndarray, lengths: list[int]) -> tuple[Any, Any]:
    q, k, _ = _inputs((2, 1, 45, 2, 1, 8), "float32")
    call, ops = attn_backends.bind(q, k, v, kv_lengths=np.array(lengths))
    out, _ = jax.jit(lambda q, k, v: decode_attention(call, q, k, v, ops, 4))(q, k, v)
    # The oracle reads every key: give it zeros where the NaNs are hidden.
    want, _ = attention(q, k, np.nan_to_num(v), kv_lengths=np.array(lengths))
    return out, want


@pytest.mark.parametrize("lengths", [[8, 3], [9, 0], [12, 12], [13, 0], [24, 1], [25, 25]])
def test_keys_past_the_prefix_are_not_read(lengths: list[int]) -> None:
    """NaN after the shortest prefix holding every length (4, 8, 12, 24 or 45
    keys here) never reaches the output: those chunks were not read."""
    v = _inputs((2, 1, 45, 2, 1, 8), "float32")[2].copy()
    prefix = next(p for p in (4, 8, 12, 24, 45) if p >= max(lengths))
    v[:, prefix:] = np.nan
    out, want = _decode_out(v, lengths)
    assert _err(out, want) <= 2e-5


def test_hidden_keys_inside_the_prefix_are_read() -> None:
    """The other side of the test above: a NaN value at a key that the
    lengths hide, but inside the prefix read, does reach the output (0 * NaN),
    so a finite output there means the key was not read."""
    v = _inputs((2, 1, 45, 2, 1, 8), "float32")[2].copy()
    v[:, 10] = np.nan
    out, _ = _decode_out(v, [9, 0])
    assert not np.all(np.isfinite(np.asarray(out)))


def _lowered(tq: int) -> str:
    q, k, v = _inputs((1, tq, 2, 2, 1, 8), "float32")
    call, ops = attn_backends.bind(q, k, v, causal=True)
    attend = jax.jit(lambda q, k, v: XlaNativeBackend().attend(call, q, k, v, ops))
    return attend.lower(q, k, v).as_text()


def test_the_plan_sends_few_queries_to_the_decode_path() -> None:
    decode = _lowered(DECODE_MAX_Q)
    # Only where jaxlib compiles the path right; the blockwise kernel otherwise.
    served = _jaxlib_at_least(DECODE_MIN_JAXLIB)
    assert ("xla_native_forward_decode" in decode) == served
    assert served or "xla_native_forward" in decode
    blockwise = _lowered(DECODE_MAX_Q + 1)
    assert "xla_native_forward" in blockwise
    assert "xla_native_forward_decode" not in blockwise


@pytest.mark.parametrize("name", ["gqa_tq1", "gqa_tq4", "mqa_tq4"])
def test_forward_alone(name: str) -> None:
    """A program with the forward only (inference): the cases above also
    hold the backward, which changes what XLA fuses."""
    q, k, v = _inputs(SHAPES[name], "float32")
    call, ops = attn_backends.bind(q, k, v, causal=True, kv_lengths=LENGTHS)
    out, lse = jax.jit(lambda q, k, v: decode_attention(call, q, k, v, ops, CHUNK))(q, k, v)
    want_out, want_lse = attention(q, k, v, causal=True, kv_lengths=LENGTHS)
    assert _err(out, want_out) <= TOLERANCE["float32"][0]
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
