"""Proof that flash_triton lowers for CUDA, on a machine without a GPU.

``jax.export`` for ``platforms=["cuda"]`` lowers the Pallas Triton kernel into
``__gpu$xla.gpu.triton`` custom calls: one for the forward, three for forward
plus VJP (forward, backward preprocessing, fused dq/dk/dv). Export refuses
custom calls it does not know to be stable, so the check is disabled for that
one target (the Triton IR inside is tied to this jaxlib, which is why it is not
on the stable list). A GPU this machine lacks is named by an abstract device
(``gpu_target``), as jax >= 0.12 needs for any Pallas Triton lowering. This checks
lowering, not GPU compilation or numerics (numerics: interpret mode and
``make test-gpu``).
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp
import pytest
from _support import gpu_target
from attn_backend_flash_triton import FlashTritonBackend, TritonBlockSizes, interpret_mode
from attn_backends.contract import jax_api

# JAX's Pallas Triton kernels are gone from jax >= 0.12 (deprecated in 0.12.0, removed in
# 0.12.1): there flash_triton is refused (test_flash_triton_plugin.py checks the reason)
# and these run on the jax 0.10 line (make test's compatibility run).
pytestmark = pytest.mark.skipif(
    jax_api.pallas_triton_ops_gone() is not None, reason="jax >= 0.12: the kernel is gone")

TRITON = "__gpu$xla.gpu.triton"
DISABLED = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]



def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _export(fn, *specs, interpret=False):
    with interpret_mode(interpret), gpu_target():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=DISABLED)(*specs)
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


def _attention():
    return attn_backends.Registry(only=["flash_triton"]).get(device="gpu")


def _fwd_bwd(attention, **kw):
    def f(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kw), q, k, v)
        return out, vjp(jnp.ones_like(out))

    return f


@pytest.mark.parametrize(
    "b, t, hq, hkv, d, dtype, causal",
    [
        (2, 1024, 8, 2, 128, "bfloat16", True),  # GQA 8:2, causal, the common training shape
        (1, 300, 4, 4, 64, "float16", False),  # T padded to 384, padded keys by segment id
        (1, 200, 4, 1, 32, "float32", True),  # MQA, padded rows hidden by the causal mask
    ],
    ids=["gqa-causal-bf16", "padded-f16", "mqa-causal-f32"],
)
def test_registry_gpu_export_forward_and_backward(b, t, hq, hkv, d, dtype, causal):
    attention = _attention()
    q, kv = _spec((b, t, hq, d), dtype), _spec((b, t, hkv, d), dtype)
    assert attention.explain(q, kv, kv, causal=causal).chosen == "flash_triton"
    forward = _export(lambda q, k, v: attention(q, k, v, causal=causal), q, kv, kv)
    assert forward.count(TRITON) == 1
    assert "attn/flash_triton" in forward
    both = _export(_fwd_bwd(attention, causal=causal), q, kv, kv)
    assert both.count(TRITON) == 3


def test_block_options_reach_the_kernel():
    blocks = TritonBlockSizes(block_q=64, block_k=32, block_q_dkv=64, block_kv_dkv=64,
                              block_q_dq=64, block_kv_dq=32)
    attention = attn_backends.Registry(only=["flash_triton"]).get(
        device="gpu", backend_options={"flash_triton": blocks})
    q = _spec((1, 256, 2, 64), "bfloat16")
    text = _export(_fwd_bwd(attention, causal=True), q, q, q)
    assert text.count(TRITON) == 3


def test_vmap_and_checkpoint_lower_for_cuda():
    attention = _attention()

    def f(q, k, v):
        step = jax.checkpoint(lambda q, k, v: attention(q, k, v, causal=True))
        return jax.vmap(step)(q, k, v)

    q = _spec((2, 1, 128, 4, 64), "bfloat16")
    text = _export(lambda q, k, v: jax.grad(lambda q: f(q, k, v).astype(jnp.float32).sum())(q),
                   q, q, q)
    assert text.count(TRITON) >= 3


def test_interpret_switch_never_reaches_a_cuda_lowering():
    # With the switch on, cpu gets the interpreter, but a cuda lowering still
    # gets the compiled kernel (lax.platform_dependent chooses at lowering).
    q = _spec((1, 64, 2, 32), "float32")
    backend = FlashTritonBackend()

    def f(q, k, v):
        call, ops = attn_backends.bind(q, k, v, causal=True)
        return backend.attend(call, q, k, v, ops)

    assert _export(_fwd_bwd(lambda q, k, v, **_: f(q, k, v)), q, q, q,
                   interpret=True).count(TRITON) == 3

