"""flash_triton in Pallas Triton interpret mode on CPU, against the float64 oracle.

The conformance suite certifies the manifest on short sequences; these add a
longer one (T=100, padded to 128) under non-default tiles (forward q blocks of
32 over kv blocks of 16, backward 16), so forward and backward cross several
tiles in both directions, with GQA, causal and the padded-key segment ids.
"""

from __future__ import annotations

import attn_backends
import jax
import numpy as np
import pytest
from attn_backend_flash_triton import FlashTritonBackend, TritonBlockSizes, interpret_mode
from attn_backends.contract import jax_api
from attn_backends_contracts._oracle import attention, attention_vjp

# JAX's Pallas Triton kernels are gone from jax >= 0.12 (deprecated in 0.12.0, removed in
# 0.12.1): there flash_triton is refused (test_flash_triton_plugin.py checks the reason)
# and these run on the jax 0.10 line (make test's compatibility run).
pytestmark = pytest.mark.skipif(
    jax_api.pallas_triton_ops_gone() is not None, reason="jax >= 0.12: the kernel is gone")

BACKEND = FlashTritonBackend()
BLOCKS = TritonBlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                          block_q_dq=16, block_kv_dq=16)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "padded-keys-masked"])
def test_multi_tile_forward_and_backward_match_the_oracle(causal):
    rng = np.random.default_rng(7)
    shapes = ((2, 100, 4, 32), (2, 100, 2, 32), (2, 100, 2, 32))
    # Committed to the CPU, so a GPU machine also runs the interpreter here
    # (its compiled kernel, with TF32 dots, is judged by make test-gpu).
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(rng.standard_normal(s).astype(np.float32), cpu) for s in shapes)
    call, operands = attn_backends.bind(q, k, v, causal=causal)
    with interpret_mode():
        fn = jax.jit(lambda q, k, v: BACKEND.attend(call, q, k, v, operands, BLOCKS))
        out, vjp = jax.vjp(fn, q, k, v)
        d_out = jax.device_put(rng.standard_normal(out.shape).astype(np.float32), cpu)
        grads = vjp(d_out)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    ref_out, _ = attention(q64, k64, v64, causal=causal)
    ref = attention_vjp(q64, k64, v64, np.asarray(d_out, np.float64), causal=causal)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-4)
    for name, got in zip("qkv", grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), ref[name], atol=1e-4, rtol=1e-4,
                                   err_msg=f"d{name}")
