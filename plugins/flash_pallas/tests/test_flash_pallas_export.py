"""Proof that flash_pallas lowers for TPU, on a machine without one.

``jax.export`` for ``platforms=["tpu"]`` lowers the Pallas kernels through
Mosaic into ``tpu_custom_call`` ops: forward and backward (jax.vjp) of a grid of
shapes and features. This checks lowering, not TPU compilation or numerics
(those need a TPU; numerics are checked in interpret mode).
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp
import pytest
from attn_backend_flash_pallas import FlashPallasBackend, SplashBlockSizes, interpret_mode

BACKEND = FlashPallasBackend()
MARKER = FlashPallasBackend.hlo_marker


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _export_fwd_bwd(b, tq, tk, hq, hkv, d, dtype, options=None, wrap=None, interpret=False,
                    **kw):
    """Export out + lse + (dq, dk, dv) for TPU; return the module text."""
    int_args = {}
    if "segment_ids" in kw:
        int_args["q_ids"] = _spec((b, tq), "int32")
        int_args["kv_ids"] = _spec((b, tk), "int32")
    if kw.pop("kv_lengths", False):
        int_args["kv_lengths"] = _spec((b,), "int32")

    def attend(q, k, v, extra):
        args = dict(kw)
        if "q_ids" in extra:
            args["segment_ids"] = (extra["q_ids"], extra["kv_ids"])
        if "kv_lengths" in extra:
            args["kv_lengths"] = extra["kv_lengths"]
        call, ops = attn_backends.bind(q, k, v, return_lse=True, **args)
        return BACKEND.attend(call, q, k, v, ops, options)

    if wrap is not None:
        attend = wrap(attend)

    def f(q, k, v, extra):
        (out, lse), vjp = jax.vjp(lambda q, k, v: attend(q, k, v, extra), q, k, v)
        return out, lse, vjp((jnp.ones_like(out), jnp.ones_like(lse)))

    with interpret_mode(interpret):
        exported = jax.export.export(jax.jit(f), platforms=["tpu"])(
            _spec((b, tq, hq, d), dtype),
            _spec((b, tk, hkv, d), dtype),
            _spec((b, tk, hkv, d), dtype),
            {**{n: s for n, s in int_args.items()}},
        )
    assert exported.platforms == ("tpu",)
    return exported.mlir_module()


def _kernel_count(text):
    return text.count(MARKER)


def test_required_shape_s1024_d128_causal_bf16_gqa_8_2():
    text = _export_fwd_bwd(2, 1024, 1024, 8, 2, 128, "bfloat16", causal=True)
    # forward, dkv and dq kernels
    assert _kernel_count(text) >= 3


@pytest.mark.parametrize("d", [64, 192, 256])
def test_head_dims_causal_bf16_gqa(d):
    assert _kernel_count(_export_fwd_bwd(1, 512, 512, 8, 2, d, "bfloat16", causal=True)) >= 3


@pytest.mark.parametrize(
    "case",
    [
        dict(window=(128, 0)),
        dict(window=(100, 50), softcap=30.0),
        dict(causal=True, segment_ids=True, kv_lengths=True),
        dict(segment_ids=True, dtype="float32"),
        dict(causal=True, tq=256, tk=1000),  # cross attention, Tk padded
        dict(hkv=1, causal=True, q_lengths=True),  # MQA
    ],
    ids=["window", "window-softcap", "causal-segments-lengths", "segments-f32", "cross", "mqa"],
)
def test_feature_grid(case):
    case = dict(case)
    shape = dict(b=2, tq=case.pop("tq", 512), tk=case.pop("tk", 512), hq=8,
                 hkv=case.pop("hkv", 2), d=128, dtype=case.pop("dtype", "bfloat16"))
    if case.pop("q_lengths", False):
        case["q_lengths"] = jnp.array([shape["tq"], 3], jnp.int32)
    assert _kernel_count(_export_fwd_bwd(**shape, **case)) >= 3


def test_fused_backward_option():
    blocks = SplashBlockSizes(block_q=256, block_kv=256, block_q_dkv=256, block_kv_dkv=256,
                              block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True)
    text = _export_fwd_bwd(1, 512, 512, 4, 4, 128, "bfloat16", options=blocks, causal=True)
    assert _kernel_count(text) >= 2


def test_vmap_and_checkpoint_lower_for_tpu():
    # Under vmap the kernels' custom_vmap rule folds the mapped axis into the batch.
    def wrap(attend):
        def batched(q, k, v, extra):
            return jax.vmap(jax.checkpoint(lambda q, k, v: attend(q, k, v, extra)))(
                q[None].repeat(2, 0), k[None].repeat(2, 0), v[None].repeat(2, 0))
        return lambda q, k, v, extra: jax.tree.map(lambda x: x.sum(0), batched(q, k, v, extra))

    text = _export_fwd_bwd(1, 256, 256, 4, 2, 128, "bfloat16", wrap=wrap, causal=True)
    assert _kernel_count(text) >= 3


def test_interpret_switch_never_reaches_a_tpu_lowering():
    # With the switch on, cpu gets the interpreter but a TPU lowering still gets
    # the compiled kernels (the choice is lax.platform_dependent's, at lowering).
    text = _export_fwd_bwd(1, 256, 256, 4, 2, 128, "float32", interpret=True, causal=True,
                           segment_ids=True)
    assert _kernel_count(text) >= 3


def test_registry_selects_flash_pallas_for_tpu_export():
    registry = attn_backends.Registry(only=["flash_pallas"])
    attention = registry.get(device="tpu", backend="flash_pallas")
    q = _spec((1, 256, 4, 128), "bfloat16")
    with interpret_mode(False):
        exported = jax.export.export(
            jax.jit(lambda q, k, v: attention(q, k, v, causal=True)), platforms=["tpu"]
        )(q, q, q)
    text = exported.mlir_module()
    assert MARKER in text and "attn/flash_pallas" in text
