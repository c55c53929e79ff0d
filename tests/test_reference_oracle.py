"""The reference backend against the NumPy float64 oracle: forward and gradients.

At least 200 random calls spanning every feature and dtype, run under JAX's
strict dtype promotion and rank promotion (as Equinox tests do), so the
backend never relies on implicit promotion.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_backend_reference import ReferenceBackend
from attn_backends import FEATURES, bind
from attn_backends_contracts import _oracle

N_CASES = 200
DTYPES = ("float32", "bfloat16", "float16")
# Error relative to the oracle's largest magnitude. float32: accumulation
# error only; bfloat16 / float16: the output and gradients are rounded to 8
# and 11 mantissa bits (PyTorch's SDPA tests use the same orders: 1e-2 bf16,
# 1e-3 f16 for outputs, looser for gradients).
TOL = {
    "float32": {"out": 2e-6, "lse": 2e-6, "grad": 2e-5},
    "bfloat16": {"out": 1e-2, "lse": 2e-6, "grad": 2e-2},
    "float16": {"out": 2e-3, "lse": 2e-6, "grad": 4e-3},
}


def random_case(seed: int) -> dict[str, Any]:
    """A random call: shapes, dtype and a random subset of every feature."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[seed % 3]
    b = int(rng.choice([1, 2, 3]))
    tq, tk = int(rng.choice([1, 3, 7, 16])), int(rng.choice([1, 5, 7, 16]))
    hkv, group = int(rng.choice([1, 2])), int(rng.choice([1, 2, 4]))
    hq, d = hkv * group, int(rng.choice([4, 8, 16]))
    dv = int(rng.choice([d, 8]))
    on = lambda: rng.random() < 0.35  # noqa: E731
    kw: dict[str, Any] = {}
    if on():
        kw["causal"] = True
    if on():
        side = lambda: None if rng.random() < 0.3 else int(rng.integers(0, 6))  # noqa: E731
        kw["window"] = (side(), side())
    if on():
        kw["segment_ids"] = (np.sort(rng.integers(0, 3, (b, tq))), np.sort(rng.integers(0, 3, (b, tk))))
    if on():
        kw["kv_lengths"] = rng.integers(0, tk + 1, (b,))
    if on():
        kw["q_lengths"] = rng.integers(0, tq + 1, (b,))
    if on():
        kw["mask"] = rng.random((int(rng.choice([1, b])), int(rng.choice([1, hq])), tq, tk)) < 0.7
    if on():
        kw["bias"] = rng.normal(size=(int(rng.choice([1, b])), int(rng.choice([1, hq])), tq, tk))
    if on():
        kw["softcap"] = float(rng.choice([2.0, 20.0]))
    if rng.random() < 0.2:
        kw["scale"] = 0.3
    q = rng.normal(size=(b, tq, hq, d))
    k = rng.normal(size=(b, tk, hkv, d))
    v = rng.normal(size=(b, tk, hkv, dv))
    return {"dtype": dtype, "q": q, "k": k, "v": v, "kw": kw, "return_lse": on(),
            "d_out": rng.normal(size=(b, tq, hq, dv)), "d_lse": rng.normal(size=(b, hq, tq))}


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values the backend actually sees after casting to dtype."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def _err(got: Any, want: np.ndarray) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)
    return float(np.max(np.abs(got - want), initial=0.0)) / scale


def _jax_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """The oracle's NumPy arguments as the JAX arrays a user would pass."""
    out = {}
    for key, val in kw.items():
        if key == "segment_ids":
            out[key] = tuple(jnp.asarray(x) for x in val)
        elif key == "bias":
            out[key] = jnp.asarray(val, jnp.float32)
        elif isinstance(val, np.ndarray):
            out[key] = jnp.asarray(val)
        else:
            out[key] = val
    return out


def test_random_cases_cover_every_feature_and_dtype():
    counts = collections.Counter()
    for seed in range(N_CASES):
        case = random_case(seed)
        q = jax.ShapeDtypeStruct(case["q"].shape, jnp.dtype(case["dtype"]))
        k = jax.ShapeDtypeStruct(case["k"].shape, q.dtype)
        v = jax.ShapeDtypeStruct(case["v"].shape, q.dtype)
        call, _ = bind(q, k, v, return_lse=case["return_lse"], **_jax_kwargs(case["kw"]))
        counts.update(call.features)
        counts[call.dtype] += 1
        counts["combined"] += len(call.features - {"return_lse"}) >= 3
    for name in (*FEATURES, *DTYPES):
        assert counts[name] >= 20, (name, counts)
    assert counts["combined"] >= 20


@pytest.mark.parametrize("seed", range(N_CASES))
def test_reference_matches_oracle(seed):
    case = random_case(seed)
    dtype = case["dtype"]
    kw = case["kw"]
    jkw = _jax_kwargs(kw)
    q, k, v = (jnp.asarray(case[n], dtype) for n in "qkv")
    call, ops = bind(q, k, v, return_lse=True, **jkw)
    backend = ReferenceBackend()

    def f(q, k, v, bias, d_out, d_lse):
        def attend(q, k, v, bias):
            return backend.attend(call, q, k, v, ops._replace(bias=bias))

        primals, vjp = jax.vjp(attend, q, k, v, bias)
        return primals, vjp((d_out, d_lse))

    d_out = jnp.asarray(case["d_out"], dtype)
    d_lse = jnp.asarray(case["d_lse"] * case["return_lse"], jnp.float32)
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        (out, lse), (dq, dk, dv, dbias) = jax.jit(f)(q, k, v, ops.bias, d_out, d_lse)

    okw = {**kw, "bias": kw.get("bias")}
    args = [_rounded(case[n], dtype) for n in "qkv"]
    want_out, want_lse = _oracle.attention(*args, **okw)
    want = _oracle.attention_vjp(*args, _rounded(case["d_out"], dtype),
                                 d_lse=case["d_lse"] * case["return_lse"], **okw)
    tol = TOL[dtype]
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert np.array_equal(np.isinf(np.asarray(lse)), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    assert _err(np.where(finite, lse, 0.0), np.where(finite, want_lse, 0.0)) <= tol["lse"]
    assert _err(out, want_out) <= tol["out"]
    for name, got in (("q", dq), ("k", dk), ("v", dv), ("bias", dbias)):
        if want[name] is None:
            continue
        assert np.isfinite(np.asarray(got, np.float32)).all(), name
        assert _err(got, want[name]) <= tol["grad"], name
