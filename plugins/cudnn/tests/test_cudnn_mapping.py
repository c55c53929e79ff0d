"""The cudnn adapter's mapping, run through jax.nn's XLA implementation, vs the float64 oracle.

``jax.nn.dot_product_attention`` computes the same function with
``implementation="xla"`` as with ``"cudnn"``, so this checks what the adapter
adds on top (bottom-right causal and windows as a mask, segment ids, empty rows
given keys and zeroed, odd lengths padded when a bias or mask is passed, query
lengths zeroed), forward and backward, in float32 for tight tolerances. The
adapter never branches on dtype. The conformance suite runs the same stand-in
in bfloat16 (``make test``); cuDNN itself is checked only on a GPU.
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_cudnn._adapter import run
from attn_backends_contracts._oracle import attention, attention_vjp

DISJOINT = (np.array([[7] * 5 + [0] * 6, [1] * 11]), np.array([[0] * 13, [1] * 6 + [2] * 7]))

CASES = {
    "causal-q7k19": dict(tq=7, tk=19, causal=True),
    "causal-q19k7-empty-rows": dict(tq=19, tk=7, causal=True),
    "window-q11k19": dict(tq=11, tk=19, window=(3, 1)),
    "segments-disjoint": dict(tq=11, tk=13, segment_ids=DISJOINT),
    "kv-lengths-zero": dict(tq=9, tk=9, causal=True, kv_lengths=np.array([0, 5])),
    "q-lengths": dict(tq=9, tk=12, q_lengths=np.array([9, 0]), kv_lengths=np.array([12, 3])),
    "odd-bias-padded": dict(tq=9, tk=13, bias="full"),
    "mask-empty-rows": dict(tq=10, tk=15, mask="empty_rows"),
    "all": dict(tq=11, tk=19, causal=True, window=(8, None), segment_ids="packed",
                kv_lengths=np.array([19, 14]), mask="per_head", bias="full"),
}


def _operands(rng, tq, tk, hq, spec):
    kw = dict(spec)
    if kw.get("bias") == "full":
        kw["bias"] = rng.standard_normal((2, hq, tq, tk)).astype(np.float32)
    if kw.get("mask") == "empty_rows":
        mask = rng.uniform(size=(2, 1, tq, tk)) < 0.7
        mask[:, :, ::3] = False
        kw["mask"] = mask
    elif kw.get("mask") == "per_head":
        kw["mask"] = rng.uniform(size=(1, hq, tq, tk)) < 0.75
    if kw.get("segment_ids") == "packed":
        kw["segment_ids"] = ((np.arange(tq) * 3 // tq)[None].repeat(2, 0),
                             (np.arange(tk) * 3 // tk)[None].repeat(2, 0))
    return kw


@pytest.mark.parametrize("name", list(CASES))
def test_mapping_matches_the_oracle(name):
    spec = dict(CASES[name])
    tq, tk = spec.pop("tq"), spec.pop("tk")
    rng = np.random.default_rng(3)
    hq, hkv, d = 4, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((2, tq, hq, d), (2, tk, hkv, d), (2, tk, hkv, d)))
    kw = _operands(rng, tq, tk, hq, spec)
    call, operands = attn_backends.bind(q, k, v, **kw)
    fn = jax.jit(lambda q, k, v: run(call, q, k, v, operands, implementation="xla"))
    out, vjp = jax.vjp(fn, q, k, v)
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    grads = vjp(d_out)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    ref_out, ref_lse = attention(q64, k64, v64, **kw)
    ref = attention_vjp(q64, k64, v64, np.asarray(d_out, np.float64), **kw)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5, rtol=1e-4)
    empty = ~np.isfinite(ref_lse).transpose(0, 2, 1)  # [B, Tq, Hq]
    assert np.all(np.asarray(out)[empty] == 0), "rows that see no key must be exact zeros"
    for n, got in zip("qkv", grads, strict=True):
        assert np.isfinite(np.asarray(got)).all(), f"d{n} not finite"
        np.testing.assert_allclose(np.asarray(got), ref[n], atol=1e-4, rtol=1e-4, err_msg=f"d{n}")
