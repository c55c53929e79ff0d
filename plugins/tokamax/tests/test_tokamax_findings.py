"""Each place tokamax disagrees with the contract (the README's findings table):
tokamax's own behaviour, shown with plain tokamax calls, and what the backend
does about it, against the float64 oracle. Tiny shapes, one compiled program
per check. Each release certified has its own findings: 0.0.12 on the jax 0.10
line, 0.0.17 on the newest (``FIXED``: what 0.0.17 no longer gets wrong; each
such test checks that the raw call now works, so a regression shows). The GPU
kernels (Triton, Mosaic GPU) cannot run here: their tests lower them for cuda
(``jax.export``) and find tokamax's kernels in the program, on the jax line and
tokamax release that serve them, and check the refusal on the others."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import gpu_target
from attn_backend_tokamax import interpret_mode
from attn_backend_tokamax._environment import import_tokamax, tokamax_version
from attn_backend_tokamax._jax_lines import (
    MOSAIC_GPU,
    MOSAIC_GPU_UNCERTIFIED,
    MOSAIC_TPU,
    TRITON,
)
from attn_backends import oracle

tokamax = import_tokamax()
#: Whether the installed tokamax is 0.0.17, where three of 0.0.12's findings are fixed.
FIXED = tokamax_version() == "0.0.17"
#: Whether this jax line serves tokamax_mosaic_tpu (jax >= 0.12; the last test says why not).
MOSAIC_SERVED = not MOSAIC_TPU.reasons()
#: Whether this jax line serves tokamax's GPU kernels (jax < 0.12 both).
TRITON_SERVED = not TRITON.reasons()
MOSAIC_GPU_SERVED = not MOSAIC_GPU.reasons() and not MOSAIC_GPU_UNCERTIFIED.reasons()
#: jax >= 0.12 warns at every Pallas Triton lowering (tokamax's Triton kernel is one).
PALLAS_TRITON_DEPRECATED = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
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
    # tokamax 0.0.17 no longer parses the command line (FIXED): the raw call runs.
    raw = "RAW UnrecognizedFlagError" in proc.stdout
    assert raw != FIXED and ("RAW" in proc.stdout) != FIXED, proc.stdout + proc.stderr[-2000:]
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
    def raw():
        return tokamax.dot_product_attention(Q, K, V, local_window_size=(1, 0),
                                             implementation="xla")

    if FIXED:
        assert raw().shape == Q.shape  # 0.0.17 builds the window for Tq != Tk
    else:
        with pytest.raises(ValueError, match="Incompatible shapes for broadcasting"):
            raw()
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
    if FIXED:  # 0.0.17 asks no F16_F16_F32 algorithm of XLA:CPU
        _close(tokamax.dot_product_attention(*half, implementation="xla"),
               oracle.attention(*half)[0], atol=2e-3)
    else:
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
                                         implementation=(_mosaic_tpu.implementation(True),))


def test_mosaic_tpu_on_jax_0_10_is_refused_with_the_suites_reason():
    with interpret_mode():
        explanation = ab.Registry(only=["tokamax_mosaic_tpu"], probe=None).get(
            device="cpu").explain(Q, K, V)
    (verdict,) = explanation.verdicts
    assert verdict.accepted == MOSAIC_SERVED
    if not MOSAIC_SERVED:
        assert "backward failed the conformance suite on jax 0.10.2" in verdict.reasons[0]


# -- GPU kernels: lowered for cuda, never run (nothing here has a GPU) --------

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"
#: Export refuses custom calls it does not know to be stable; these carry kernel
#: code tied to this jaxlib (as flash_triton's export test says).
UNSTABLE_OK = [jax.export.DisabledSafetyCheck.custom_call(call)
               for call in (TRITON_CALL, MOSAIC_GPU_CALL)]
GPU_Q = jax.ShapeDtypeStruct((2, 200, 8, 64), jnp.bfloat16)  # T=200: not a multiple of any block
GPU_KV = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)


class FakeHopperDevice:
    """What tokamax reads of JAX's default device to pick its Mosaic GPU kernel
    (``platform``, ``compute_capability``), as an H100 has them. JAX accepts a
    default device whose type's name holds "Device"; it is set only while
    attention is traced, so the lowering itself never sees it."""

    platform = "gpu"
    device_kind = "NVIDIA H100 80GB HBM3"
    compute_capability = "9.0"
    id = 0


def _export_for_cuda(fn, *specs, hopper: bool = False) -> str:
    """The cuda export of ``fn(*specs)``; ``hopper``: traced with an H100 as JAX's
    default device (tokamax's Mosaic GPU asks it for the kernel to lower)."""

    def traced(*args):
        with jax.default_device(FakeHopperDevice()) if hopper else contextlib.nullcontext():
            return fn(*args)

    with gpu_target():
        exported = jax.export.export(jax.jit(traced), platforms=["cuda"],
                                     disabled_checks=UNSTABLE_OK)(*specs)
    return exported.mlir_module()


def _forward_and_backward(attention, **kw):
    def f(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kw), q, k, v)
        return out, vjp(jnp.ones_like(out))

    return f


def _gpu_attention(name: str) -> ab.Attention:
    return ab.Registry(only=[name], probe=None).get(device="gpu", backend=name,
                                                    fallback="error")


def _gpu_refusal(name: str, hopper: bool = False) -> list[str]:
    with jax.default_device(FakeHopperDevice()) if hopper else contextlib.nullcontext():
        explanation = ab.Registry(only=[name], probe=None).get(device="gpu").explain(
            GPU_Q, GPU_KV, GPU_KV, causal=True)
    (verdict,) = explanation.verdicts
    return list(verdict.reasons)


def jax_0_10_deprecations_in_tokamax(test):
    """What jax 0.10 warns of in tokamax's Triton path: its kernel's pl.dot moved
    (to jax.experimental.pallas.triton; jax 0.12 removed it: the refusal), and
    its XLA backward's jax.core.DropVar and jaxprs built without debug info."""
    for message in ("jax.experimental.pallas.dot was moved", "jax.core.DropVar is deprecated",
                    "core.Jaxpr is missing a DebugInfo object"):
        test = pytest.mark.filterwarnings(f"ignore:{message}:DeprecationWarning")(test)
    return test


@PALLAS_TRITON_DEPRECATED
@jax_0_10_deprecations_in_tokamax
def test_triton_tokamax_has_no_interpret_mode_and_jax_s_switch_cannot_run_it():
    # tokamax passes no `interpret` to its pallas_call. JAX's own switch (the
    # config force_tpu_interpret_mode sets; True picks the generic interpreter)
    # reaches the kernel: on jax 0.10.2 a forward without is_causal runs and
    # matches the oracle, but a causal forward and every backward fail to lower
    # (tokamax calls pl.program_id inside the kernels' loops and conds), so the
    # suite cannot run it. tokamax 0.0.17 on jax 0.12: the causal forward runs
    # too, the backward still fails. (0.0.12 on jax 0.12: pl.dot is gone first.)
    from attn_backend_tokamax import _gpu_kernels
    from jax._src import config as jax_config

    def attention(q, k, v, causal=False):
        return tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                             implementation=(_gpu_kernels.triton(False),))

    def gradients(q, k, v):
        return jax.grad(lambda q: attention(q, k, v).sum())(q)

    unlowerable = "primitive 'program_id' not found for platform cpu"
    switch = jax_config.pallas_tpu_interpret_mode_context_manager
    before = switch.swap_local(True)
    try:
        if not TRITON_SERVED:
            with pytest.raises(AttributeError, match="pl.dot was deprecated"):
                jax.jit(attention)(Q, K, V)
            return
        if FIXED:  # 0.0.17's causal forward runs there; its backward still does not
            assert jax.jit(functools.partial(attention, causal=True))(Q, K, V).shape == Q.shape
        else:
            with pytest.raises(NotImplementedError, match=unlowerable):
                jax.jit(functools.partial(attention, causal=True))(Q, K, V)
        with pytest.raises(NotImplementedError, match=unlowerable):
            jax.jit(gradients)(Q, K, V)
        out = jax.jit(attention)(Q, K, V)
    finally:
        switch.set_local(before)
    _close(out, oracle.attention(Q, K, V)[0])


@PALLAS_TRITON_DEPRECATED
@jax_0_10_deprecations_in_tokamax
def test_triton_lowers_for_cuda_through_the_registry():
    if not TRITON_SERVED:
        (reason,) = _gpu_refusal("tokamax_triton")
        assert "calls pl.dot, which JAX 0.12 removed" in reason and "tokamax 0.0.12" in reason
        with pytest.raises(AttributeError, match="pl.dot was deprecated"):
            tokamax_triton_raw_export()
        return
    attention = _gpu_attention("tokamax_triton")
    forward = _export_for_cuda(lambda q, k, v: attention(q, k, v, causal=True),
                               GPU_Q, GPU_KV, GPU_KV)
    assert forward.count(TRITON_CALL) == 1 and "attn/tokamax_triton" in forward
    both = _export_for_cuda(_forward_and_backward(attention, causal=True), GPU_Q, GPU_KV, GPU_KV)
    assert both.count(TRITON_CALL) == 2  # the forward, and dq/dk/dv in one kernel
    # Softcap: tokamax's Triton backward raises for it; the XLA backward stands in.
    capped = _export_for_cuda(_forward_and_backward(attention, softcap=20.0, window=(16, 0)),
                              GPU_Q, GPU_KV, GPU_KV)
    assert capped.count(TRITON_CALL) == 1
    from attn_backend_tokamax import _gpu_kernels

    def raw(q, k, v):
        return tokamax.dot_product_attention(q, k, v, logits_soft_cap=20.0,
                                             implementation=(_gpu_kernels.triton(False),))

    with pytest.raises(NotImplementedError, match="`logits_soft_cap` unsupported"):
        _export_for_cuda(_forward_and_backward(raw), GPU_Q, GPU_KV, GPU_KV)


def tokamax_triton_raw_export() -> str:
    """tokamax's Triton implementation (past its supported_on) exported for cuda."""
    from attn_backend_tokamax import _gpu_kernels

    return _export_for_cuda(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, implementation=(_gpu_kernels.triton(False),)), GPU_Q, GPU_KV, GPU_KV)


def test_mosaic_gpu_tokamax_asks_the_default_device_ours_says_where_to_certify():
    def raw(q, k, v):
        return tokamax.dot_product_attention(q, k, v, implementation="mosaic_gpu")

    with pytest.raises(NotImplementedError, match="Not supported on cpu"):
        _export_for_cuda(raw, GPU_Q, GPU_KV, GPU_KV)
    # Past supported_on (tokamax's cross_compile option), its forward asks again.
    from tokamax._src.ops.attention import pallas_mosaic_gpu, pallas_mosaic_gpu_kernel_sm90

    sm90 = pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(
        config=pallas_mosaic_gpu_kernel_sm90.Config(block_q=64, block_kv=64, num_stages=2))
    # (0.0.17 asks through JAX's Mosaic GPU, which wants an sm80+ GPU here.)
    asked = "only supported for sm80" if FIXED else "only supported for sm90"
    with tokamax.config.cross_compile(True), pytest.raises(NotImplementedError, match=asked):
        _export_for_cuda(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, implementation=(sm90,)), GPU_Q, GPU_KV, GPU_KV)
    reasons = _gpu_refusal("tokamax_mosaic_gpu")
    assert any("here it is a cpu device: certify on a Hopper (sm90) or Blackwell GPU: "
               "make test-gpu" in r for r in reasons), reasons
    hopper_reasons = _gpu_refusal("tokamax_mosaic_gpu", hopper=True)
    assert hopper_reasons == ([] if MOSAIC_GPU_SERVED
                              else MOSAIC_GPU.reasons() + MOSAIC_GPU_UNCERTIFIED.reasons())


@pytest.mark.filterwarnings(
    "ignore:The out_shape and scratch_shapes arguments to plgpu.kernel are deprecated")
def test_mosaic_gpu_lowers_for_cuda_on_a_hopper_default_device_on_jax_0_10():
    if FIXED:  # tokamax 0.0.17: not certified (its gate says why), refused on every line
        (reason,) = MOSAIC_GPU_UNCERTIFIED.reasons()
        assert "tokamax 0.0.17's Mosaic GPU kernels are not certified" in reason
        assert _gpu_refusal("tokamax_mosaic_gpu", hopper=True) == [reason]
        return
    if not MOSAIC_GPU_SERVED:
        (reason,) = MOSAIC_GPU.reasons()
        assert "plgpu.kernel(out_shape=...)" in reason and "tokamax 0.0.12" in reason
        with pytest.raises(TypeError, match="unexpected keyword argument 'out_shape'"):
            _export_for_cuda(lambda q, k, v: tokamax.dot_product_attention(
                q, k, v, implementation="mosaic_gpu"), GPU_Q, GPU_KV, GPU_KV, hopper=True)
        return
    attention = _gpu_attention("tokamax_mosaic_gpu")
    forward = _export_for_cuda(lambda q, k, v: attention(q, k, v, causal=True),
                               GPU_Q, GPU_KV, GPU_KV, hopper=True)
    assert forward.count(MOSAIC_GPU_CALL) == 1 and "attn/tokamax_mosaic_gpu" in forward
    # The kernel gets T = 200 padded to 256 (a multiple of 128): tokamax alone would
    # pad only the keys, and not hide them without a mask.
    assert ("(tensor<2x256x8x64xbf16>, tensor<2x256x2x64xbf16>, tensor<2x256x2x64xbf16>) -> "
            "tensor<2x256x8x64xbf16>") in forward
    both = _export_for_cuda(_forward_and_backward(attention, causal=True),
                            GPU_Q, GPU_KV, GPU_KV, hopper=True)
    assert both.count(MOSAIC_GPU_CALL) == 3  # the forward, dq, and dk/dv
