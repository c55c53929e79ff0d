"""bind(): every "Bad calls" row of FAULTS.md raises ValueError naming the argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends import AttentionCall, bind
from attn_backends.authoring import CLAIMABLE_DTYPES

Q = jnp.zeros((2, 6, 4, 8))
K = jnp.zeros((2, 10, 2, 8))
V = jnp.zeros((2, 10, 2, 16))


def test_normalises_into_a_frozen_hashable_call():
    call, ops = bind(Q, K, V, causal=True, window=(3, None), return_lse=True)
    assert call == AttentionCall(
        batch=2, q_len=6, kv_len=10, q_heads=4, kv_heads=2, head_dim=8, v_head_dim=16,
        dtype="float32", scale=8**-0.5, causal=True, window=(3, None), return_lse=True,
    )
    assert hash(call) == hash(bind(Q, K, V, causal=True, window=(3, None), return_lse=True)[0])
    assert call.group == 2 and call.offset == 4
    assert call.features == {"gqa", "causal", "window", "return_lse"}
    with pytest.raises(AttributeError):
        call.causal = False  # type: ignore[misc]
    assert ops.mask is None and ops.bias is None


def test_window_of_two_unbounded_sides_is_no_window():
    assert bind(Q, K, V, window=(None, None))[0].window is None


def test_shape_dtype_structs_bind_without_data():
    sds = jax.ShapeDtypeStruct
    call, _ = bind(sds((1, 3, 2, 4), jnp.bfloat16), sds((1, 5, 1, 4), jnp.bfloat16),
                   sds((1, 5, 1, 4), jnp.bfloat16))
    assert call.dtype == "bfloat16" and call.group == 2


def _raises(match: str, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        bind(*args, **kwargs)


@pytest.mark.parametrize(
    "q,k,v,match",
    [
        (jnp.zeros((2, 6, 8)), K, V, r"q: expected rank 4 .* got shape \(2, 6, 8\)"),
        (Q, K, jnp.zeros((2, 10, 2, 16, 1)), r"v: expected rank 4"),
        # BHTD passed where BTNH is expected: heads and lengths swap places.
        (jnp.zeros((2, 4, 6, 8)), jnp.zeros((2, 2, 10, 8)), jnp.zeros((2, 2, 10, 8)),
         r"heads: expected q heads Hq=6 to be a multiple of kv heads Hkv=10.*transpose"),
        (jnp.zeros((2, 6, 3, 8)), K, V,
         r"heads: expected q heads Hq=3 to be a multiple of kv heads Hkv=2"),
        (Q, jnp.zeros((2, 10, 2, 7)), V, r"k: expected head dim D=8 \(from q\), got 7"),
        (Q, K, jnp.zeros((2, 9, 2, 16)), r"k, v: expected the same length Tk, got 10 and 9"),
        (Q, K, jnp.zeros((2, 10, 1, 16)), r"k, v: expected the same kv heads, got 2 and 1"),
        (Q, jnp.zeros((3, 10, 2, 8)), jnp.zeros((3, 10, 2, 16)),
         r"batch: expected q, k, v to share B, got 2, 3, 3"),
        (jnp.zeros((2, 6, 4, 0)), jnp.zeros((2, 10, 2, 0)), V,
         r"q: expected at least one head and a head dim >= 1, got Hq=4, D=0"),
        (jnp.zeros((2, 6, 0, 8)), K, V,
         r"q: expected at least one head and a head dim >= 1, got Hq=0, D=8"),
        # Abstract shapes can hold what no array can: found before any backend or probe runs.
        (jax.ShapeDtypeStruct((2, -6, 4, 8), jnp.float32), K, V,
         r"q: expected sizes >= 0, got shape \[2, -6, 4, 8\]"),
        (Q, K, jax.ShapeDtypeStruct((2, 10, 2, -3), jnp.float32),
         r"v: expected sizes >= 0, got shape \[2, 10, 2, -3\]"),
    ],
)
def test_bad_shapes(q, k, v, match):
    _raises(match, q, k, v)


def test_mixed_dtypes():
    _raises(r"q, k, v: expected one dtype, got q=float32, k=bfloat16, v=float32",
            Q, K.astype(jnp.bfloat16), V)


def test_integer_and_complex_inputs_say_what_the_contract_takes():
    ints = np.zeros((2, 6, 4, 8), np.int32)
    _raises(r"q: expected dtype float32, bfloat16 or float16 \(float64 under jax_enable_x64\), "
            r"got int32\.$", ints, ints, ints)
    c = np.zeros((2, 6, 4, 8), np.complex64)
    _raises(r"q: .* got complex64\. Attention's softmax is defined for real logits", c, c, c)


def test_float64_binds_only_where_jax_keeps_it():
    q = np.zeros((2, 6, 4, 8), np.float64)
    # Without x64 JAX would compute float32: refused, saying how to get float64.
    _raises(r"q: dtype float64 needs jax_enable_x64 .* cast to float32", q, q, q)
    with jax.enable_x64(True):
        call, _ = bind(q, q, q, bias=np.zeros((1, 1, 6, 6)))
        assert call.dtype == call.bias_dtype == "float64"
        with pytest.raises(ValueError, match=r"bias: .* got complex128\. Attention's softmax"):
            bind(q, q, q, bias=np.zeros((1, 1, 6, 6), np.complex128))


def test_not_an_array():
    _raises(r"q: expected an array .* got list", [[1.0]], K, V)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mask": jnp.ones((2, 4, 6, 9), bool)},
         r"mask: expected shape \[B\|1, Hq\|1, Tq, Tk\] = \[2\|1, 4\|1, 6, 10\] "
         r"or a key mask \[2\|1, 1, 1, 10\], got \[2, 4, 6, 9\]"),
        ({"mask": jnp.ones((2, 2, 6, 10), bool)}, r"mask: expected shape .* got \[2, 2, 6, 10\]"),
        ({"mask": jnp.ones((6, 10), bool)}, r"mask: expected shape .* got \[6, 10\]"),
        ({"mask": jnp.ones((1, 1, 6, 10), jnp.float32)},
         r"mask: expected dtype bool .* got float32"),
        ({"bias": jnp.ones((3, 4, 6, 10))}, r"bias: expected shape .* got \[3, 4, 6, 10\]"),
        ({"bias": jnp.ones((1, 1, 6, 10), jnp.int32)},
         r"bias: expected dtype float32, bfloat16 or float16 \(float64 under jax_enable_x64\), "
         r"got int32"),
        ({"segment_ids": jnp.zeros((2, 6), jnp.int32)}, r"segment_ids: expected a pair"),
        ({"segment_ids": (jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 9), jnp.int32))},
         r"segment_ids\[1\] \(kv_ids\): expected shape \[2, 10\], got \[2, 9\]"),
        ({"segment_ids": (jnp.zeros((2, 6)), jnp.zeros((2, 10), jnp.int32))},
         r"segment_ids\[0\] \(q_ids\): expected an integer dtype, got float32"),
        ({"kv_lengths": jnp.zeros((3,), jnp.int32)},
         r"kv_lengths: expected shape \[2\], got \[3\]"),
        ({"q_lengths": jnp.zeros((2,), jnp.float32)},
         r"q_lengths: expected an integer dtype, got float32"),
        ({"window": (-1, 4)}, r"window: left side must be >= 0 .* got -1"),
        ({"window": (4, -2)}, r"window: right side must be >= 0 .* got -2"),
        ({"window": 5}, r"window: expected \(left, right\)"),
        ({"window": (1.5, 2)}, r"window: left side must be an int or None, got 1.5"),
        ({"softcap": 0.0}, r"softcap: expected a finite value > 0, got 0.0"),
        ({"softcap": -3.0}, r"softcap: expected a finite value > 0, got -3.0"),
        ({"scale": float("nan")},
         r"scale: expected a finite number within float32.s range, got nan"),
        ({"scale": float("inf")},
         r"scale: expected a finite number within float32.s range, got inf"),
        ({"scale": 1e39},
         r"scale: expected a finite number within float32's range, got 1e\+39"),
        ({"scale": jnp.float32(0.5)}, r"scale: expected a static Python float"),
        ({"causal": 1},
         r"causal: expected a Python bool .* got int\. Under jit, mark it static"),
    ],
)
def test_bad_optional_arguments(kwargs, match):
    _raises(match, Q, K, V, **kwargs)


def test_traced_scale_is_rejected_with_a_fix():
    def f(scale):
        return bind(Q, K, V, scale=scale)

    with pytest.raises(
        ValueError, match=r"scale: expected a static Python float .* Pass float\(scale\)"
    ):
        jax.jit(f)(0.5)


def test_broadcast_mask_and_bias_shapes_are_accepted():
    call, _ = bind(Q, K, V, mask=jnp.ones((1, 4, 6, 10), bool), bias=jnp.zeros((2, 1, 6, 10)))
    assert call.mask_shape == (1, 4, 6, 10) and call.bias_shape == (2, 1, 6, 10)
    assert {"mask", "bias"} <= call.features


def test_float64_reaches_only_a_backend_that_claims_it(fake_registry):
    import attn_backends as ab
    from _support import make_backend

    def never(*args):
        raise AssertionError("a backend not claiming float64 was handed a float64 call")

    narrow = make_backend("narrow", priority=9, attend=never)  # default dtypes: no float64
    wide = make_backend("wide", priority=1)
    type(wide).capabilities = dataclasses.replace(wide.capabilities, dtypes=CLAIMABLE_DTYPES)
    reg = fake_registry(narrow, wide)
    q = np.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 8)))
    with jax.enable_x64(True):
        with pytest.raises(ab.UnsupportedError,
                           match=r"'narrow' cannot serve .* float64 on cpu: dtype float64 not in "
                           r"\['bfloat16', 'float16', 'float32'\]"):
            reg.get(device="cpu", backend="narrow")(q, q, q)
        att = reg.get(device="cpu", fallback="silent")
        assert att.explain(q, q, q).chosen == "wide"
        assert att(q, q, q).dtype == np.float64


def test_one_keyword_definition_serves_the_call_bind_and_the_oracle(fake_registry):
    from _support import make_backend
    from attn_backends import oracle
    from attn_backends.contract.call import KEYWORD_DEFAULTS, AttentionKeywords, LogitKeywords

    assert list(KEYWORD_DEFAULTS) == ["scale", "causal", "window", "segment_ids", "q_lengths",
                                      "kv_lengths", "mask", "bias", "softcap", "return_lse",
                                      "dropout_rate", "dropout_key", "k_scales", "v_scales"]
    assert set(AttentionKeywords.__annotations__) == set(KEYWORD_DEFAULTS)
    q = k = v = np.ones((1, 4, 2, 8), np.float32)
    typo = r"unexpected keyword argument\(s\) \['casual'\]; it takes .*causal"
    with pytest.raises(TypeError, match=r"attention\(\) got " + typo):
        bind(q, k, v, casual=True)
    with pytest.raises(TypeError, match=r"attention\(\) got " + typo):
        fake_registry(make_backend("fake")).get(device="cpu")(q, k, v, casual=True)
    with pytest.raises(TypeError, match=r"oracle\.attention\(\) got " + typo):
        oracle.attention(q, k, v, casual=True)
    # The oracle takes the keywords that shape the weights, not the call's own.
    assert "return_lse" not in LogitKeywords.__annotations__
    with pytest.raises(TypeError, match=r"\['return_lse'\]"):
        oracle.attention(q, k, v, return_lse=True)
    out, _ = oracle.attention(q, k, v, causal=True, scale=0.5)
    assert out.shape == (1, 4, 2, 8)
