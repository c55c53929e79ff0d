"""Quantized paged caches in core (docs/DESIGN.md, "Quantized caches"): the
quantizer against an independent NumPy one, the rule for zeros and non-finite
rows, bad input named, and selection that moves past a backend declining the
cache with its reason in ``explain``.

The backends are the installed reference, xla_native and native_cpu (each
claims every quantized dtype), and a fake that claims none.
"""

from __future__ import annotations

import attn_backends as ab
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.authoring import QUANTIZED_KV_DTYPES, quantize
from attn_backends.oracle import paged_case
from attn_backends.probe.paged_inputs import dequantize_rows, half_step, quantize_rows

CALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
QUANTIZED = QUANTIZED_KV_DTYPES


@pytest.fixture
def registry() -> ab.Registry:
    return ab.Registry(probe=None, only=["reference", "xla_native", "native_cpu"])


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_the_quantizer_equals_an_independent_numpy_one(kv_dtype: str) -> None:
    rng = np.random.default_rng(3)
    # Rows of every magnitude: the float8 formats' subnormals and their top.
    x = rng.normal(size=(64, 2, 16)) * 10.0 ** rng.uniform(-6, 4, size=(64, 2, 1))
    x = x.astype(np.float32)
    values, scales = (np.asarray(a) for a in quantize(jnp.asarray(x), kv_dtype))
    want_values, want_scales = quantize_rows(x, kv_dtype)
    assert values.dtype == want_values.dtype and scales.dtype == np.float32
    # XLA divides by the constant as a multiplication by its reciprocal: the
    # scales agree to float32 rounding, and a value may then round the other way.
    np.testing.assert_allclose(scales, want_scales, rtol=2.5e-7, atol=0)
    differ = values.astype(np.float64) != want_values.astype(np.float64)
    assert differ.mean() < 0.01, f"{differ.sum()} of {differ.size} values differ"
    err = np.abs(dequantize_rows(values, scales) - x)
    assert np.all(err <= half_step(values, kv_dtype) * scales[..., None]
                  + 1e-6 * np.abs(x))


@pytest.mark.parametrize("dim", [4, 128])
def test_zeros_and_non_finite_rows_follow_the_rule(dim: int) -> None:
    import jax

    x = np.ones((3, 2, dim), np.float32)
    x[0] = 0.0
    x[1, 0, 3] = np.nan
    x[2, 1, 0] = -np.inf
    for kv_dtype in QUANTIZED:
        # Jitted, as write runs it. (A max over the row dropped a NaN inside
        # flash_pallas' write program at head dim 128: the suite's store case.)
        run = jax.jit(lambda x, c=kv_dtype: quantize(x, c))
        values, scales = (np.asarray(a).astype(np.float64) for a in run(jnp.asarray(x)))
        assert scales[0].tolist() == [0.0, 0.0] and not values[0].any()
        assert np.isnan(scales[1, 0]) and np.isnan(scales[2, 1])
        assert not values[1, 0].any() and not values[2, 1].any()
        # The other head of the same token is untouched by its neighbour's NaN.
        np.testing.assert_allclose(values[1, 1] * scales[1, 1], 1.0, rtol=1e-6)
        np.testing.assert_allclose(values[2, 0] * scales[2, 0], 1.0, rtol=1e-6)


def test_a_kv_dtype_that_is_not_quantized_is_named(registry: ab.Registry) -> None:
    with pytest.raises(ValueError, match=r"kv_dtype: expected one of \['int8'"):
        registry.get_paged(device="cpu", backend="reference", kv_dtype="float16", **CALL)
    # The call's own dtype is a cache in that dtype: no quantization.
    plain = registry.get_paged(device="cpu", backend="reference", kv_dtype="float32",
                               **CALL)
    assert plain.call.kv_dtype is None


def test_bad_scales_and_unquantized_calls_are_named(registry: ab.Registry) -> None:
    case = paged_case([(2, 6), (1, 3)], page_size=4, hq=4, hkv=2, d=16, garbage=False,
                      kv_dtype="int8")
    k, v, ks, vs = (jnp.asarray(x) for x in case.canonical())
    int8 = registry.get_paged(device="cpu", backend="xla_native", kv_dtype="int8", **CALL)
    with pytest.raises(ValueError, match=r"k_scales: expected shape \[5, 4, 2\], got \[5, 4\]"):
        int8.from_canonical(k, v, ks[..., 0], vs)
    with pytest.raises(ValueError, match=r"v_scales: expected dtype float32 \(a quantized "
                                         r"cache's scales\), got bfloat16"):
        int8.from_canonical(k, v, ks, vs.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="k_scales: missing; a int8 cache needs"):
        int8.from_canonical(k, v)
    with pytest.raises(ValueError, match="k_pages: expected dtype int8, got float32"):
        int8.from_canonical(k.astype(jnp.float32), v, ks, vs)
    cache = int8.from_canonical(k, v, ks, vs)

    plain = registry.get_paged(device="cpu", backend="xla_native", **CALL)
    # An int8 cache handed to a paged attention got without kv_dtype.
    with pytest.raises(ValueError, match=r"cache: got a quantized cache \(4 arrays: int8, "
                                         r"int8, float32, float32\).*kv_dtype='int8'"):
        plain(jnp.asarray(case.q), cache, case.batch())
    with pytest.raises(ValueError, match="k_pages: expected dtype float32, got int8; for a "
                                         "quantized cache get the paged attention with "
                                         "kv_dtype='int8'"):
        plain.from_canonical(k, v)
    with pytest.raises(ValueError, match="k_scales: given, but this paged attention's cache "
                                         "is not quantized"):
        plain.from_canonical(k.astype(jnp.float32), v.astype(jnp.float32), ks, vs)
    # A float8 cache handed to an int8 attention: the array and both dtypes named.
    fp8 = registry.get_paged(device="cpu", backend="xla_native", kv_dtype="float8_e5m2",
                             **CALL)
    with pytest.raises(ValueError, match="cache: expected its k_pages .* dtype float8_e5m2, "
                                         "got .* dtype int8"):
        fp8(jnp.asarray(case.q), cache, case.batch())


def test_a_backend_reading_no_quantized_cache_is_passed_over_with_its_reason() -> None:
    """A fake paged backend above xla_native that claims no quantized cache."""
    from _paged_support import make_paged_backend
    from _support import Plugin
    from attn_backend_xla_native._plugin import XlaNativeBackend

    registry = ab.Registry(probe=None, autoload=False, plugins=[
        Plugin(make_paged_backend("plain", priority=99)), Plugin(XlaNativeBackend())])
    explanation = registry.explain_paged(device="cpu", kv_dtype="float8_e4m3fn", **CALL)
    verdicts = {v.backend: v for v in explanation.verdicts}
    assert not verdicts["plain"].accepted
    assert verdicts["plain"].reasons == (
        "kv dtype float8_e4m3fn: reads no such quantized K, V (reads none)",)
    assert explanation.chosen == "xla_native"
    assert "kv_dtype=float8_e4m3fn" in str(explanation)
    with pytest.warns(ab.FallbackWarning, match="passing over plain: kv dtype"):
        registry.get_paged(device="cpu", kv_dtype="float8_e4m3fn", **CALL)
    with pytest.raises(ab.UnsupportedError, match="backend='plain' cannot serve .* "
                                                  "kv_dtype=int8 on cpu: kv dtype int8"):
        registry.get_paged(device="cpu", backend="plain", kv_dtype="int8", **CALL)


def test_a_quantized_cache_serves_step_after_step_as_a_user_keeps_it(
        registry: ab.Registry) -> None:
    """One int8 cache, written and read over several jitted steps (decode after a
    prefill), equals the float64 oracle on the cache as it stands after each write."""
    import jax

    paged = registry.get_paged(device="cpu", backend="xla_native", kv_dtype="int8", **CALL)
    rng = np.random.default_rng(0)
    cache = paged.init_cache(8)
    step = jax.jit(lambda c, k, v, s, q, b: (lambda c2: (c2, paged(q, c2, b)))(
        paged.write(c, k, v, s)), donate_argnums=0)
    table = np.array([[5, 2, 7, 0]], np.int32)
    length = 0
    for new in (6, 1, 1, 3):
        slots = np.array([table[0, p // 4] * 4 + p % 4 for p in range(length, length + new)],
                         np.int32)
        k, v, q = (rng.normal(size=(new, h, 16)).astype(np.float32) for h in (2, 2, 4))
        length += new
        batch = ab.PagedBatch(jnp.asarray([0, new], jnp.int32), jnp.asarray([length], jnp.int32),
                              jnp.asarray(table), jnp.int32(1))
        cache, out = step(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                          jnp.asarray(q), batch)
        kp, vp, ks, vs = (np.asarray(x) for x in paged.to_canonical(cache))
        from attn_backends.oracle import paged_attention as oracle

        want = oracle(q, kp * ks[..., None].astype(np.float64),
                      vp * vs[..., None].astype(np.float64), [0, new], [length], table, 1,
                      scale=paged.call.scale)
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


def test_the_pre_0_2_names_of_quantized_k_and_v_still_work_and_say_so(registry) -> None:
    from attn_backends.contract import call as contract_call

    with pytest.warns(DeprecationWarning, match=r"cache_dtype= is deprecated: use kv_dtype="):
        paged = registry.get_paged(device="cpu", cache_dtype="int8", **CALL)
    assert paged.call.kv_dtype == "int8"
    with pytest.warns(DeprecationWarning, match=r"PagedCall.cache_dtype is deprecated"):
        assert paged.call.cache_dtype == "int8"
    with pytest.warns(DeprecationWarning, match=r"cache_dtypes=\) is deprecated"):
        caps = ab.PagedCapabilities(platforms={"cpu"}, cache_dtypes={"int8"})
    assert caps.kv_dtypes == {"int8"}
    with pytest.warns(DeprecationWarning, match=r"QUANTIZED_CACHE_DTYPES moved to "
                                                r"attn_backends.authoring.QUANTIZED_KV_DTYPES"):
        assert ab.QUANTIZED_CACHE_DTYPES == contract_call.QUANTIZED_KV_DTYPES
