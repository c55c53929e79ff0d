"""flash_pallas in Pallas TPU interpret mode on CPU, against the float64 oracle.

Every claimed feature, forward and backward (including the lse cotangent), in
float32 and bfloat16. Shapes stay tiny (T <= 256, blocks of 128) because the
interpreter is slow; each case compiles once (forward and vjp in one program).
Lengths like 200 and 130 are not multiples of 128, so padding is always on.
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_flash_pallas import FlashPallasBackend, SplashBlockSizes, interpret_mode
from attn_backends_contracts._oracle import attention, attention_vjp, visibility

BACKEND = FlashPallasBackend()
TOL = {"float32": 2e-4, "bfloat16": 3e-2}
#: Finite but huge: what hidden positions hold in the ``garbage`` cases. With it
#: in a hidden key, splash's unmasked ``ds = p * (dp - di)`` is ``0 * inf``.
GARBAGE = 3e37


def _inputs(rng, b, tq, tk, hq, hkv, d, dtype, dv=None):
    shapes = ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, dv or d))
    arrays = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
    return arrays, [np.asarray(a, np.float64) for a in arrays]


def _with_garbage(q, k, v, hq, **kw):
    """GARBAGE in every key no live row sees and in every row past ``q_lengths``."""
    b, tq, _, _ = q.shape
    tk = k.shape[1]
    masking = {n: x for n, x in kw.items() if n not in ("softcap", "scale")}
    seen = visibility(b, hq, tq, tk, **masking).any(axis=(1, 2))  # [B, Tk]
    k = jnp.where(seen[:, :, None, None], k, GARBAGE).astype(k.dtype)
    v = jnp.where(seen[:, :, None, None], v, -GARBAGE).astype(v.dtype)
    if kw.get("q_lengths") is not None:
        live = np.arange(tq)[None, :] < np.asarray(kw["q_lengths"])[:, None]
        q = jnp.where(live[:, :, None, None], q, GARBAGE).astype(q.dtype)
    assert (~seen).any(), "a garbage case must hide some key"
    return q, k, v


def _check_case(
    *, b=2, tq=200, tk=200, hq=4, hkv=2, d=64, dv=None, dtype="float32", seed=0,
    garbage=False, **kw
):
    """Run forward + vjp (with out and lse cotangents); compare all with the oracle.

    ``garbage``: hidden keys and rows past ``q_lengths`` hold GARBAGE, which must
    change nothing (the oracle gets the same arrays: it ignores hidden positions).
    """
    rng = np.random.default_rng(seed)
    (q, k, v), _ = _inputs(rng, b, tq, tk, hq, hkv, d, dtype, dv)
    if garbage:
        q, k, v = _with_garbage(q, k, v, hq, **kw)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    call, operands = attn_backends.bind(q, k, v, return_lse=True, **kw)
    with interpret_mode():
        fn = jax.jit(lambda q, k, v: BACKEND.attend(call, q, k, v, operands))
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        d_out = jnp.asarray(rng.standard_normal(out.shape), dtype)
        ref_out, ref_lse = attention(q64, k64, v64, **kw)
        dead = ~np.isfinite(ref_lse)
        d_lse = jnp.asarray(np.where(dead, 0.0, rng.standard_normal(lse.shape)), jnp.float32)
        grads = vjp((d_out, d_lse))
    ref = attention_vjp(
        q64, k64, v64, np.asarray(d_out, np.float64), d_lse=np.asarray(d_lse, np.float64), **kw
    )
    assert out.dtype == q.dtype and out.shape == (b, tq, hq, dv or d)
    assert lse.dtype == jnp.float32 and lse.shape == (b, hq, tq)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=tol, rtol=tol)
    lse = np.asarray(lse, np.float64)
    assert np.array_equal(np.isneginf(lse), dead), "lse must be -inf exactly on unseeing rows"
    np.testing.assert_allclose(lse[~dead], ref_lse[~dead], atol=tol, rtol=tol)
    for name, got in zip("qkv", grads, strict=True):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), f"d{name} has non-finite entries"
        scale = max(1.0, float(np.abs(ref[name]).max()))
        np.testing.assert_allclose(got, ref[name], atol=tol * scale, rtol=tol, err_msg=f"d{name}")
    return np.asarray(out, np.float64), dead


def test_plain_gqa_padded_lengths_float32():
    _check_case()


def test_causal_cross_attention_shorter_q_bfloat16_mqa():
    # Bottom-right causal: query i sees keys j <= i + 100.
    _check_case(tq=100, tk=200, hq=4, hkv=1, causal=True, dtype="bfloat16")


def test_causal_longer_q_gives_zero_rows_and_zero_grads():
    # Tq > Tk: the first Tq - Tk rows see no key (whole 128-row blocks are skipped).
    out, dead = _check_case(b=1, tq=200, tk=60, hq=2, hkv=2, causal=True)
    assert dead.sum() == 2 * 140
    assert np.all(out[:, :140] == 0.0)


def test_window_and_softcap_float32_with_wider_v():
    _check_case(tq=130, tk=130, hq=2, hkv=1, dv=128, window=(17, 5), softcap=4.0)


@pytest.mark.parametrize("tq, tk", [(1, 130), (130, 1)], ids=["decode-Tq1", "Tk1"])
def test_length_one_causal(tq, tk):
    _check_case(b=1, tq=tq, tk=tk, hq=2, hkv=1, causal=True)


def test_causal_with_left_window_bfloat16():
    # Rows past q_lengths and the keys only they would see hold garbage.
    _check_case(tq=200, tk=200, hq=4, hkv=2, causal=True, window=(40, None), dtype="bfloat16",
                q_lengths=np.array([150, 200], np.int32), garbage=True)


def test_segment_ids_and_lengths_with_empty_example():
    rng = np.random.default_rng(3)
    q_ids = np.sort(rng.integers(0, 3, (2, 200)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 3, (2, 200)), axis=1).astype(np.int32)
    kv_ids[0, 120:] = 7  # segment 7 exists only on the kv side; it must stay invisible
    _, dead = _check_case(
        segment_ids=(q_ids, kv_ids),
        kv_lengths=np.array([150, 0], np.int32),
        q_lengths=np.array([180, 200], np.int32),
        garbage=True,
    )
    assert dead[1].all() and dead[0, :, 180:].all()


def test_segment_ids_causal_bfloat16():
    ids = np.repeat(np.arange(4, dtype=np.int32), [30, 70, 90, 10])[None].repeat(2, 0)
    # softcap: splash differentiates tanh of the unmasked q·k, so hidden keys
    # (past kv_lengths, holding garbage) must be zeros by the time it runs.
    _check_case(segment_ids=(ids, ids), causal=True, softcap=30.0, dtype="bfloat16",
                kv_lengths=np.array([190, 120], np.int32), garbage=True)


def test_masking_flags_change_the_output():
    # Guards against a kernel that ignores the mask: causal must differ from full.
    rng = np.random.default_rng(5)
    (q, k, v), _ = _inputs(rng, 1, 130, 130, 2, 2, 64, "float32")
    outs = []
    with interpret_mode():
        for causal in (False, True):
            call, ops = attn_backends.bind(q, k, v, causal=causal)
            outs.append(np.asarray(BACKEND.attend(call, q, k, v, ops)))
    assert np.abs(outs[0] - outs[1]).max() > 1e-2
    np.testing.assert_allclose(outs[0][:, -1], outs[1][:, -1], atol=1e-5)  # last row sees all


def test_vmap_checkpoint_and_grad_against_oracle_per_example():
    # vmap over a leading axis reaches the kernels through their custom_vmap rule,
    # which folds it into the batch; jax.checkpoint must not break the custom VJP.
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 1, 130, 2, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 1, 130, 1, 64)), jnp.float32)
    ids = np.sort(rng.integers(0, 3, (2, 1, 130)), axis=-1).astype(np.int32)

    def one(q, k, ids):
        call, ops = attn_backends.bind(q, k, k, segment_ids=(ids, ids))
        return BACKEND.attend(call, q, k, k, ops)

    with interpret_mode():
        mapped = jax.vmap(jax.checkpoint(one))
        loss = jax.jit(jax.value_and_grad(lambda q, k: (mapped(q, k, ids) ** 2).sum()))
        value, grad_q = loss(q, k)
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    want, want_dq = 0.0, []
    for n in range(2):
        seg = (ids[n], ids[n])
        o, _ = attention(q64[n], k64[n], k64[n], segment_ids=seg)
        want += float((o**2).sum())
        want_dq.append(attention_vjp(q64[n], k64[n], k64[n], 2 * o, segment_ids=seg)["q"])
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_q), np.stack(want_dq), atol=2e-4)


def test_options_block_sizes_are_used():
    # 256-row blocks on a 130-long sequence: padding to 256, one block; same answer.
    rng = np.random.default_rng(9)
    (q, k, v), (q64, k64, v64) = _inputs(rng, 1, 130, 130, 2, 1, 64, "float32")
    call, ops = attn_backends.bind(q, k, v, causal=True)
    blocks = SplashBlockSizes(block_q=256, block_kv=256, block_kv_compute=128,
                              block_q_dkv=256, block_kv_dkv=256, block_q_dq=256, block_kv_dq=256)
    with interpret_mode():
        out = BACKEND.attend(call, q, k, v, ops, options=blocks)
    np.testing.assert_allclose(np.asarray(out), attention(q64, k64, v64, causal=True)[0], atol=2e-4)
    with pytest.raises(ValueError, match="options"):
        BACKEND.attend(call, q, k, v, ops, options={"block_q": 128})
