"""``registry.get(layout="BHTD")``: PyTorch-layout code says what it passes.

A ``[B, H, T, D]`` array whose head counts divide is also a valid BTNH array
(attention over H tokens and T heads), so shapes alone cannot tell: the
layout is said, not guessed. Where a wrongly shaped mask, bias or ids shows
that q, k, v are BHTD, the ValueError says so and names ``layout=``.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import make_backend, qkv
from attn_backends import Registry, hookimpl, oracle
from attn_backends_cli.main import main
from attn_backends_contracts.hlo import compiled_instructions
from jax.sharding import PartitionSpec as P


def _bhtd(x: jax.Array) -> jax.Array:
    return x.transpose(0, 2, 1, 3)


def test_bhtd_forward_lse_and_grads_match_the_oracle_in_bhtd(fake_registry):
    registry = fake_registry(make_backend("fake"))
    attention = registry.get(device="cpu", layout="BHTD")
    # GQA 4:2, Tq != Tk, a mask and a bias: every shape the layout moves or keeps.
    q, k, v = (_bhtd(x) for x in qkv(b=2, tq=6, tk=9, hq=4, hkv=2, d=8, seed=3))
    rng = np.random.default_rng(4)
    mask = rng.uniform(size=(2, 1, 6, 9)) > 0.3
    mask[..., 0] = True
    bias = rng.standard_normal((1, 4, 6, 9)).astype(np.float32)
    out, lse = attention(q, k, v, causal=True, mask=mask, bias=bias, return_lse=True)
    assert out.shape == (2, 4, 6, 8) and lse.shape == (2, 4, 6)
    f64 = [np.asarray(_bhtd(x), np.float64) for x in (q, k, v)]
    want, want_lse = oracle.attention(*f64, causal=True, mask=mask, bias=bias)
    np.testing.assert_allclose(np.asarray(out), _bhtd(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)

    weight = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
    grads = jax.grad(lambda *a: jnp.sum(attention(*a, causal=True) * weight), (0, 1, 2))(q, k, v)
    want_grads = oracle.attention_vjp(*f64, _bhtd(weight), causal=True)
    for got, name in zip(grads, "qkv", strict=True):
        assert got.shape == (q, k, v)["qkv".index(name)].shape
        np.testing.assert_allclose(np.asarray(got), _bhtd(want_grads[name]), atol=1e-5, rtol=1e-5)


def test_bhtd_compiles_to_the_program_of_transposing_by_hand(fake_registry):
    registry = fake_registry(make_backend("fake"))
    bhtd, btnh = registry.get(device="cpu", layout="BHTD"), registry.get(device="cpu")
    q, k, v = (_bhtd(x) for x in qkv(b=1, tq=16, tk=16, hq=4, hkv=2, d=8))
    ours = jax.jit(lambda q, k, v: bhtd(q, k, v, causal=True)).lower(q, k, v).compile()
    by_hand = jax.jit(
        lambda q, k, v: _bhtd(btnh(_bhtd(q), _bhtd(k), _bhtd(v), causal=True))
    ).lower(q, k, v).compile()
    assert compiled_instructions(ours) == compiled_instructions(by_hand)


def test_explain_reads_the_same_layout(fake_registry):
    registry = fake_registry(make_backend("fake"))
    sds = jax.ShapeDtypeStruct
    q, kv = sds((2, 8, 128, 64), jnp.float32), sds((2, 2, 128, 64), jnp.float32)
    call = registry.get(device="cpu", layout="BHTD").explain(q, kv, kv).call
    assert (call.q_len, call.q_heads, call.kv_len, call.kv_heads) == (128, 8, 128, 2)
    assert registry.explain(q, kv, kv, device="cpu", layout="BHTD").call == call
    # The same shapes read as BTNH: 8 tokens and 128 heads, as the issue found.
    plain = registry.explain(q, kv, kv, device="cpu").call
    assert (plain.q_len, plain.q_heads) == (8, 128)


def test_cli_explain_takes_a_layout(capsys, monkeypatch):
    registry = ab.Registry(plugins=[_plugin()], autoload=False, probe=None)
    monkeypatch.setattr(ab.choose.registry, "registry", registry)
    argv = ["explain", "--device", "cpu", "--q", "2,8,128,64", "--kv", "2,2,96,64", "--mask"]
    assert main([*argv, "--layout", "BHTD"]) == 0
    assert "q[2,128,8,64] kv[2,96,2,64/64] float32 gqa mask" in capsys.readouterr().out


def _plugin() -> object:
    class Plugin:
        @ab.hookimpl
        def attn_backends_register(self):
            return [make_backend("fake")]

    return Plugin()


def test_a_mask_or_ids_that_show_bhtd_arrays_say_layout(fake_registry):
    attention = fake_registry(make_backend("fake")).get(device="cpu")
    q = jnp.zeros((2, 8, 128, 64))  # [B, H, T, D]: valid BTNH, 8 tokens and 128 heads
    k = jnp.zeros((2, 2, 128, 64))
    with pytest.raises(ValueError, match=r"mask: .*look like \[B, H, T, D\].*layout='BHTD'"):
        attention(q, k, k, mask=jnp.ones((2, 1, 128, 128), bool))
    with pytest.raises(ValueError, match=r"bias: .*look like \[B, H, T, D\].*layout='BHTD'"):
        attention(q, k, k, bias=jnp.zeros((1, 1, 128, 128)))
    ids = jnp.zeros((2, 128), jnp.int32)
    with pytest.raises(ValueError, match=r"q_ids.*look like \[B, H, T, D\].*layout='BHTD'"):
        attention(q, k, k, segment_ids=(ids, ids))
    # A mask merely of the wrong size gets no such guess.
    with pytest.raises(ValueError, match=r"mask: expected shape") as wrong:
        attention(q, k, k, mask=jnp.ones((2, 1, 8, 7), bool))
    assert "layout" not in str(wrong.value)
    # Said, the same arrays and mask run.
    bhtd = fake_registry(make_backend("fake")).get(device="cpu", layout="BHTD")
    assert bhtd(q, k, k, mask=jnp.ones((2, 1, 128, 128), bool)).shape == q.shape


def test_bad_layouts_are_refused_by_name(fake_registry):
    registry = fake_registry(make_backend("fake"))
    with pytest.raises(ValueError, match=r"layout: expected one of \('BTNH', 'BHTD'\)"):
        registry.get(layout="BNTH")
    q = jnp.zeros((2, 8, 16))
    with pytest.raises(ValueError, match=r"k: expected rank 4 \[B, H, T, D\] \(layout='BHTD'\)"):
        registry.get(device="cpu", layout="BHTD")(jnp.zeros((2, 8, 16, 4)), q, q)


def test_a_bhtd_spec_reaches_the_parallel_layer_in_btnh_order():
    requests = []

    class Parallel:
        @hookimpl
        def attn_backends_sharding_request(self, mesh, spec, sequence_axis, ring_block):
            requests.append((mesh, spec, sequence_axis, ring_block))
            return spec

    registry = Registry(plugins=[_plugin(), Parallel()], autoload=False, probe=None)
    registry.get(layout="BHTD", spec=P("dp", "tp"))
    registry.get(spec=P("dp", "tp"))
    assert [r[1] for r in requests] == [P("dp", None, "tp", None), P("dp", "tp")]
