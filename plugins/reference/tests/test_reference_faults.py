"""FAULTS.md "Bad calls" rows about numbers, for the reference through the registry.

(Every backend meets the same rows in the conformance suite; these keep the
reference, the yardstick of probes, honest on its own.)
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import qkv
from attn_backends_contracts import _oracle


@pytest.fixture(scope="module")
def attention():
    return ab.Registry(only=["reference"], probe=None).get(device="cpu", backend="reference")


def _np(x):
    return np.asarray(x, np.float64)


def test_huge_and_equal_logits_stay_finite_and_match_the_oracle(attention):
    q, k, v = qkv(tq=7, tk=9)
    big_q, big_k = q * 1e3, k * 1e3
    out = attention(big_q, big_k, v, causal=True)
    want, _ = _oracle.attention(_np(big_q), _np(big_k), _np(v), causal=True)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(_np(out), want, atol=2e-5)
    equal = attention(jnp.zeros_like(q), k, v)
    np.testing.assert_allclose(
        _np(equal), _oracle.attention(0 * _np(q), _np(k), _np(v))[0], atol=1e-6
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_in_a_visible_key_poisons_only_rows_that_see_it(attention, bad):
    q, k, v = qkv(tq=6, tk=6, hq=2, hkv=2)
    k = k.at[0, 3, 0, 0].set(bad)  # key 3 of example 0, head 0
    out = np.asarray(attention(q, k, v, causal=True))
    rows_seeing_key3 = np.arange(6) >= 3
    assert not np.isfinite(out[0, rows_seeing_key3, 0]).all(axis=-1).any()
    assert np.isfinite(out[0, ~rows_seeing_key3, 0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(out[0, :, 1]).all()


def test_finite_garbage_in_invisible_positions_changes_nothing(attention):
    q, k, v = qkv(tq=5, tk=8)
    lengths = jnp.array([5, 8], jnp.int32)
    garbage_k = k.at[0, 5:].set(1e30)
    garbage_v = v.at[0, 5:].set(-3e30)
    clean = attention(q, k, v, kv_lengths=lengths)
    dirty = attention(q, garbage_k, garbage_v, kv_lengths=lengths)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))


@pytest.mark.parametrize(
    "case",
    ["causal_tq_gt_tk", "kv_lengths_zero", "disjoint_segments", "q_lengths"],
)
def test_fully_masked_rows_give_zeros_neg_inf_lse_and_zero_gradients(attention, case):
    q, k, v = qkv(tq=6, tk=4)
    kw = {}
    if case == "causal_tq_gt_tk":
        kw = {"causal": True}  # rows 0 and 1 see j <= i - 2: nothing
        empty = (slice(None), slice(0, 2))
    elif case == "kv_lengths_zero":
        kw = {"kv_lengths": jnp.array([0, 4], jnp.int32)}
        empty = (0, slice(None))
    elif case == "disjoint_segments":
        kw = {
            "segment_ids": (
                jnp.zeros((2, 6), jnp.int32),
                jnp.ones((2, 4), jnp.int32).at[1].set(0),
            )
        }
        empty = (0, slice(None))
    else:
        kw = {"q_lengths": jnp.array([2, 6], jnp.int32)}
        empty = (0, slice(2, None))
    out, lse = attention(q, k, v, return_lse=True, **kw)
    assert not np.asarray(out)[empty].any()
    lse_rows = np.asarray(lse).transpose(0, 2, 1)[empty]
    assert np.isneginf(lse_rows).all()

    def loss(q, k, v):
        o, row_lse = attention(q, k, v, return_lse=True, **kw)
        return (o**2).sum() + jnp.where(jnp.isfinite(row_lse), row_lse, 0.0).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert not np.asarray(grads[0])[empty].any()
    want = _oracle.attention(_np(q), _np(k), _np(v), **{
        key: (tuple(map(np.asarray, val)) if key == "segment_ids" else
              np.asarray(val) if hasattr(val, "shape") else val)
        for key, val in kw.items()
    })[0]
    np.testing.assert_allclose(_np(out), want, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {"window": (1, 1)},
        {"segment_ids": (jnp.array([[0, 0, 1, 1, 1]] * 2), jnp.array([[0, 1, 1, 1, 1]] * 2))},
        {"mask": jnp.asarray(np.random.default_rng(0).random((1, 1, 5, 5)) < 0.5)},
    ],
    ids=["causal", "window", "segments", "mask"],
)
def test_a_mask_changes_the_output_and_matches_the_oracle(attention, kw):
    q, k, v = qkv(tq=5, tk=5)
    masked, unmasked = attention(q, k, v, **kw), attention(q, k, v)
    assert np.abs(np.asarray(masked) - np.asarray(unmasked)).max() > 1e-2
    okw = {key: (tuple(map(np.asarray, val)) if key == "segment_ids" else
                 np.asarray(val) if hasattr(val, "shape") else val) for key, val in kw.items()}
    np.testing.assert_allclose(
        _np(masked), _oracle.attention(_np(q), _np(k), _np(v), **okw)[0], atol=1e-6
    )


def test_causal_with_tq_greater_than_tk_forward_and_backward(attention):
    q, k, v = qkv(tq=9, tk=3)
    d_out = jnp.ones((2, 9, 4, 8))
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=True), q, k, v)
    dq, dk, dv = vjp(d_out)
    want = _oracle.attention_vjp(_np(q), _np(k), _np(v), _np(d_out), causal=True)
    for got, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        np.testing.assert_allclose(_np(got), want[name], atol=2e-5)
