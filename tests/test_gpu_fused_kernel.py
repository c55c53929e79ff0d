"""A gpu gets a fused kernel on every jax line the repository locks, lowered here for cuda.

``registry.get(device="gpu")`` on this GPU-less machine selects by manifest and
``check`` alone, as a user's export for a GPU does. jax 0.12.1 removed the
Pallas Triton kernels flash_triton wraps: there it must be refused with that
reason, and tokamax_triton (tokamax 0.0.17's Pallas Triton flash attention)
serve instead; on the jax 0.10 line flash_triton still serves. Either way the
program holds Triton custom calls forward and backward, and no dense
``[T, T]`` logits in XLA outside them. make test runs this file on both lines.
"""

from __future__ import annotations

import re

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from _support import gpu_target
from attn_backends.contract import jax_api

TRITON = "__gpu$xla.gpu.triton"
GONE = jax_api.pallas_triton_ops_gone()
#: What serves a plain causal GQA call for a gpu on this jax line.
FUSED = "tokamax_triton" if GONE else "flash_triton"
B, T, HQ, HKV, D = 2, 1024, 8, 2, 64


def _lowered(fn, *specs) -> str:
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*specs)
    return exported.mlir_module()


# JAX warns at every Pallas Triton lowering on jax >= 0.12 that its Triton backend is
# deprecated (for Mosaic GPU): a lowering inside tokamax's kernel, named in its README.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_registry_gpu_lowers_a_fused_kernel_for_cuda_forward_and_backward() -> None:
    attention = ab.Registry(probe=None).get(device="gpu", fallback="silent")
    q = jax.ShapeDtypeStruct((B, T, HQ, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, HKV, D), jnp.bfloat16)
    explanation = attention.explain(jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
                                    jnp.zeros(k.shape, k.dtype), causal=True)
    assert explanation.chosen == FUSED, str(explanation)
    (flash,) = [v for v in explanation.verdicts if v.backend == "flash_triton"]
    assert list(flash.reasons) == ([GONE] if GONE else []), flash

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=True), q, k, v)
        return out, vjp(jnp.ones_like(out))

    with gpu_target():
        forward = _lowered(lambda q, k, v: attention(q, k, v, causal=True), q, k, k)
        both = _lowered(forward_backward, q, k, k)
    assert forward.count(TRITON) >= 1 and both.count(TRITON) > forward.count(TRITON)
    # No [T, T] logits in XLA: the attention stays inside the kernels.
    assert not re.search(rf"tensor<[^>]*\b{T}x{T}x", both)
    assert f"attn/{FUSED}" in both


def test_flash_triton_is_refused_with_the_reason_where_its_kernel_is_gone() -> None:
    registry = ab.Registry(only=["flash_triton", "reference"], probe=None)
    q = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    explanation = registry.get(device="gpu").explain(q, q, q, causal=True)
    if GONE:
        assert explanation.chosen == "reference"
        assert "removed in 0.12.1" in str(explanation)
    else:
        assert explanation.chosen == "flash_triton"
