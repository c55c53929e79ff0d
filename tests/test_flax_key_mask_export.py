"""flax's key masks reach the Pallas kernel in a TPU export (bf16, head dim 128).

flax hands its attention a key mask ``[B, 1, 1, Tk]`` for a padding mask and,
with ``decode=True``, for the filled part of its cache. flash_pallas claims
segment ids but not masks: the registry hands it the mask as segment ids
(docs/DESIGN.md, section 4), so both exports hold ``tpu_custom_call`` and no
FallbackWarning is raised on the way.
"""

from __future__ import annotations

import warnings

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from attn_backends_flax import attention_fn
from flax import nnx

B, T, HEADS, D = 2, 256, 4, 128


@pytest.fixture
def tpu_attention_fn(monkeypatch):
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    registry = ab.Registry(only=["flash_pallas", "xla_native", "reference"], probe=None)
    return attention_fn(registry.get(device="tpu"))


def _module(fn, decode: bool) -> nnx.MultiHeadAttention:
    return nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=HEADS * D, qkv_features=HEADS * D, decode=decode,
        dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention_fn=fn, rngs=nnx.Rngs(0),
    )


def _export(fn, *args) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ab.FallbackWarning)
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def test_flax_decode_step_with_its_cache_mask_exports_the_pallas_kernel(tpu_attention_fn):
    module = _module(tpu_attention_fn, decode=True)
    module.init_cache((B, T, HEADS * D), dtype=jnp.bfloat16)
    graph, state = nnx.split(module)
    token = jax.ShapeDtypeStruct((B, 1, HEADS * D), jnp.bfloat16)

    def step(state, token):
        m = nnx.merge(graph, state)
        out = m(token)
        return out, nnx.state(m)

    exported = _export(step, state, token)
    assert "tpu_custom_call" in exported and "attn/flash_pallas" in exported
    explanation = tpu_attention_fn.attention.explain(
        jax.ShapeDtypeStruct((B, 1, HEADS, D), jnp.bfloat16),
        *[jax.ShapeDtypeStruct((B, T, HEADS, D), jnp.bfloat16)] * 2,
        mask=jax.ShapeDtypeStruct((B, 1, 1, T), jnp.bool_))
    verdict = {v.backend: v for v in explanation.verdicts}["flash_pallas"]
    assert explanation.chosen == "flash_pallas"
    assert verdict.notes == ("key mask rewritten as segment ids",)


def test_flax_padded_mask_forward_exports_the_pallas_kernel(tpu_attention_fn):
    graph, state = nnx.split(_module(tpu_attention_fn, decode=False))
    inputs = jax.ShapeDtypeStruct((B, T, HEADS * D), jnp.bfloat16)
    padding = jax.ShapeDtypeStruct((B, 1, 1, T), jnp.bool_)

    def forward(state, x, mask):
        return nnx.merge(graph, state)(x, mask=mask)

    exported = _export(forward, state, inputs, padding)
    assert "tpu_custom_call" in exported and "attn/flash_pallas" in exported


def test_a_query_padding_mask_still_falls_back_with_the_reason(tpu_attention_fn):
    # make_attention_mask(query, key) varies by query row: not a key mask.
    graph, state = nnx.split(_module(tpu_attention_fn, decode=False))
    inputs = jax.ShapeDtypeStruct((B, T, HEADS * D), jnp.bfloat16)
    pairwise = jax.ShapeDtypeStruct((B, 1, T, T), jnp.bool_)

    def forward(state, x, mask):
        return nnx.merge(graph, state)(x, mask=mask)

    with pytest.warns(ab.FallbackWarning, match="flash_pallas: feature 'mask' not supported"):
        exported = jax.export.export(jax.jit(forward), platforms=["tpu"])(
            state, inputs, pairwise).mlir_module()
    assert "tpu_custom_call" not in exported
