"""Each place tokamax 0.0.12 disagrees with the contract (the README's findings
table): tokamax's own behaviour, shown with plain tokamax calls, and what the
backend does about it, against the float64 oracle. Tiny shapes, one compiled
program per check."""

from __future__ import annotations

import subprocess
import sys

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_tokamax import interpret_mode
from attn_backend_tokamax._environment import import_tokamax
from attn_backend_tokamax._plugin import mosaic_tpu_jax_reasons
from attn_backends import oracle

tokamax = import_tokamax()
#: Whether this jax line serves tokamax_mosaic_tpu (jax >= 0.12; the last test says why not).
MOSAIC_SERVED = not mosaic_tpu_jax_reasons()
RNG = np.random.default_rng(0)
Q, K, V = (jnp.asarray(RNG.standard_normal(s), jnp.float32)
           for s in ((1, 4, 2, 8), (1, 6, 1, 8), (1, 6, 1, 8)))


def _attention(name: str = "tokamax_xla") -> ab.Attention:
    return ab.Registry(only=[name], probe=None).get(device="cpu", backend=name, fallback="error")


def _ours(**kw):
    return _attention()(Q, K, V, **kw)


def _close(got, want, atol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=0)


def test_absl_flags_tokamax_parses_the_whole_command_line():
    # tokamax reads its config from absl flags and parses sys.argv on first read.
    code = (
        "import sys; sys.argv = ['train.py', '--steps=3']\n"
        "import jax.numpy as jnp, tokamax\n"
        "x = jnp.ones((1, 4, 1, 8))\n"
        "try:\n"
        "    tokamax.dot_product_attention(x, x, x, implementation='xla')\n"
        "except Exception as e:\n"
        "    print('RAW', type(e).__name__)\n"
        "import attn_backends as ab\n"
        "att = ab.Registry(only=['tokamax_xla'], probe=None).get(device='cpu', "
        "backend='tokamax_xla')\n"
        "print('OURS', att(x, x, x).shape)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "RAW UnrecognizedFlagError" in proc.stdout, proc.stderr[-2000:]
    assert "OURS (1, 4, 1, 8)" in proc.stdout, proc.stderr[-2000:]


def test_a_row_with_no_visible_key_tokamax_gives_the_mean_of_v_ours_zeros():
    mask = jnp.ones((1, 1, 4, 6), bool).at[:, :, 1].set(False)
    raw = tokamax.dot_product_attention(Q, K, V, mask=mask, implementation="xla")
    _close(raw[0, 1, 0], np.asarray(V[0, :, 0]).mean(0))
    want, _ = oracle.attention(Q, K, V, mask=mask)
    assert not want[0, 1].any()
    _close(_ours(mask=mask), want)
    # The empty row's output has no gradient (tokamax's mean of V would give v one).
    dv = jax.grad(lambda v: (_attention()(Q, K, v, mask=mask)[0, 1] ** 2).sum())(V)
    assert not np.asarray(dv).any()


def test_causal_tokamax_aligns_top_left_ours_bottom_right():
    raw = tokamax.dot_product_attention(Q, K, V, is_causal=True, implementation="xla")
    _close(raw[0, 0, 0], np.asarray(V[0, 0, 0]))  # row 0 sees key 0 only
    want, _ = oracle.attention(Q, K, V, causal=True)  # row 0 sees keys 0..2
    _close(_ours(causal=True), want)


def test_window_tokamax_fails_when_tq_differs_from_tk_ours_serves_it():
    with pytest.raises(ValueError, match="Incompatible shapes for broadcasting"):
        tokamax.dot_product_attention(Q, K, V, local_window_size=(1, 0), implementation="xla")
    want, _ = oracle.attention(Q, K, V, window=(1, 0))
    _close(_ours(window=(1, 0)), want)


def test_softcap_tokamax_caps_after_the_bias_ours_declines_both():
    bias = jnp.asarray(RNG.standard_normal((1, 2, 4, 6)) * 3, jnp.float32)
    raw = tokamax.dot_product_attention(Q, K, V, bias=bias, logits_soft_cap=2.0,
                                        implementation="xla")
    scale = 8 ** -0.5
    s = jnp.einsum("bqhd,bkd->bhqk", Q, K[:, :, 0]) * scale
    theirs = jax.nn.softmax(2.0 * jnp.tanh((s + bias) / 2.0), axis=-1)
    _close(raw, jnp.einsum("bhqk,bkd->bqhd", theirs, V[:, :, 0]))
    with pytest.raises(ab.UnsupportedError, match="tokamax caps scale"):
        _ours(bias=bias, softcap=2.0)


def test_float16_tokamax_fails_on_cpu_ours_computes_it_in_float32():
    half = [x.astype(jnp.float16) for x in (Q, K, V)]
    with pytest.raises(ValueError, match="F16_F16_F32"):
        tokamax.dot_product_attention(*half, implementation="xla")
    attention = ab.Registry(only=["tokamax_xla"], probe=None).get(device="cpu")
    out = attention(*half)
    assert out.dtype == jnp.float16
    _close(out, oracle.attention(*half)[0], atol=2e-3)


def test_mosaic_tpu_tokamax_asks_the_default_device_ours_the_lowering_platform():
    # tokamax's supported_on is asked of the default device (cpu here): a TPU
    # export from a cpu host is refused, and so is interpret mode on cpu.
    spec = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)

    def raw(q, k, v):
        return tokamax.dot_product_attention(q, k, v, implementation="mosaic_tpu")

    with pytest.raises(NotImplementedError, match="Not supported on cpu"):
        jax.export.export(jax.jit(raw), platforms=["tpu"])(spec, spec, spec)
    if not MOSAIC_SERVED:
        return  # refused on this jax line: test_mosaic_tpu_on_jax_0_10
    attention = ab.Registry(only=["tokamax_mosaic_tpu"], probe=None).get(device="tpu")
    exported = jax.export.export(jax.jit(lambda q, k, v: attention(q, k, v, causal=True)),
                                 platforms=["tpu"])(spec, spec, spec)
    assert exported.mlir_module().count("tpu_custom_call") == 1


def test_mosaic_tpu_blocks_must_divide_the_sequence_ours_pads():
    # Interpret mode, forward only: 5 query rows, 7 keys, padded to 128.
    q, k, v = (jnp.asarray(RNG.standard_normal(s), jnp.float32)
               for s in ((1, 5, 2, 64), (1, 7, 2, 64), (1, 7, 2, 64)))
    with pytest.raises(ValueError, match="should divide q_seq_len=5"):
        tokamax_mosaic_tpu_raw(q, k, v)
    if not MOSAIC_SERVED:
        return  # refused on this jax line: test_mosaic_tpu_on_jax_0_10
    with interpret_mode():
        attention = ab.Registry(only=["tokamax_mosaic_tpu"], probe=None).get(device="cpu")
        out = attention(q, k, v, causal=True)
    _close(out, oracle.attention(q, k, v, causal=True)[0])


def tokamax_mosaic_tpu_raw(q, k, v):
    """tokamax's Mosaic TPU implementation interpreted on cpu, past its supported_on."""
    from attn_backend_tokamax import _mosaic_tpu

    return tokamax.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=_mosaic_tpu.implementation(True))


def test_mosaic_tpu_on_jax_0_10_is_refused_with_the_suites_reason():
    with interpret_mode():
        explanation = ab.Registry(only=["tokamax_mosaic_tpu"], probe=None).get(
            device="cpu").explain(Q, K, V)
    (verdict,) = explanation.verdicts
    assert verdict.accepted == MOSAIC_SERVED
    if not MOSAIC_SERVED:
        assert "backward failed the conformance suite on jax 0.10.2" in verdict.reasons[0]
