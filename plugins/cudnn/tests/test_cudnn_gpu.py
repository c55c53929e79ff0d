"""cudnn where cuDNN is: lowering for cuda, and numerics on a GPU against the float64 oracle.

Lowering needs JAX's CUDA plugin with cuDNN (``attn-backend-cudnn[cuda]``);
numerics need a GPU too. Without them these tests skip, naming what is missing
(on the machine this project is developed on there is neither: see the README).
``make test-gpu`` runs them, and the full conformance suite, on a GPU.
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_cudnn import CudnnBackend, cudnn_version, local_compute_capability
from attn_backends_contracts._oracle import attention, attention_vjp

MARKER = CudnnBackend.hlo_marker

needs_cudnn = pytest.mark.skipif(
    cudnn_version() is None,
    reason="JAX finds no cuDNN here: needs jax-cuda12-plugin and nvidia-cudnn-cu12 "
           '(pip install "attn-backend-cudnn[cuda]")',
)
needs_gpu = pytest.mark.skipif(
    local_compute_capability() is None, reason="no CUDA GPU visible to JAX on this machine"
)


def _fwd_bwd(attention_fn, **kw):
    def f(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention_fn(q, k, v, **kw), q, k, v)
        return out, vjp(jnp.ones_like(out))

    return f


@needs_cudnn
def test_registry_gpu_export_holds_cudnn_forward_and_backward():
    attention_fn = attn_backends.Registry(only=["cudnn"]).get(device="gpu", backend="cudnn")
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
    forward = jax.export.export(
        jax.jit(lambda q, k, v: attention_fn(q, k, v, causal=True)), platforms=["cuda"]
    )(q, kv, kv).mlir_module()
    assert forward.count(MARKER) == 1 and "attn/cudnn" in forward
    both = jax.export.export(jax.jit(_fwd_bwd(attention_fn, causal=True)),
                             platforms=["cuda"])(q, kv, kv).mlir_module()
    assert both.count(MARKER) >= 2  # forward and backward custom calls


@needs_cudnn
@needs_gpu
@pytest.mark.parametrize(
    "tq, tk, kw",
    [
        (128, 128, dict(causal=True)),
        (64, 192, dict(causal=True)),  # bottom-right, through the mask
        (96, 96, dict(kv_lengths=np.array([96, 0], np.int32))),  # an empty batch entry
        (33, 47, dict(window=(8, 0))),  # odd lengths, padded
    ],
    ids=["causal", "causal-q64k192", "kv-lengths-zero", "window-odd"],
)
def test_numerics_on_gpu_match_the_oracle(tq, tk, kw):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((2, tq, 8, 64), (2, tk, 2, 64), (2, tk, 2, 64)))
    attention_fn = attn_backends.Registry(only=["cudnn"], probe=None).get(
        device="gpu", backend="cudnn")
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: attention_fn(q, k, v, **kw)), q, k, v)
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
    grads = vjp(d_out)
    q64, k64, v64, do64 = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    ref_out, _ = attention(q64, k64, v64, **kw)
    ref = attention_vjp(q64, k64, v64, do64, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=2e-2, rtol=2e-2)
    for name, got in zip("qkv", grads, strict=True):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), f"d{name} not finite"
        scale = max(1.0, float(np.abs(ref[name]).max()))
        np.testing.assert_allclose(got, ref[name], atol=5e-2 * scale, rtol=5e-2, err_msg=name)
