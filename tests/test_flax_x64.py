"""attn_backends_flax under ``jax_enable_x64``: float64 modules decode through the
registry in float64 (linen and nnx), and complex inputs are refused saying why.

flax's own einsum attention (``flax.linen.dot_product_attention``) in float64
is the oracle: the backend computes in float64 too, so the two agree to
float64 rounding, far below anything a float32 step inside reaches (~1e-7).
nnx's default attention is not the oracle here: it calls
``jax.nn.dot_product_attention``, whose logits are float32 even for float64
inputs (it differs from float64 attention by ~1.5e-7).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _flax_support import PRIMARY, ours
from flax import nnx

F, HEADS, STEPS, BATCH = 16, 2, 9, 2
#: float64 rounding of these sums; a float32 step anywhere gives ~1e-7.
F64_ATOL = 1e-12


def _einsum_attention(*args, is_causal: bool = False, **kwargs):  # noqa: ANN002, ANN003
    """flax.linen's float64 einsum attention under nnx's attention_fn signature."""
    assert not is_causal  # decode steps mask through the cache, never is_causal
    return nn.dot_product_attention(*args, **kwargs)


def _inputs() -> jax.Array:
    rng = np.random.default_rng(3)
    return jnp.asarray(rng.standard_normal((BATCH, STEPS, F)), jnp.float64)


def _close(got: jax.Array, want: jax.Array) -> None:
    assert got.dtype == want.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("backend", [PRIMARY, "reference"])
def test_linen_autoregressive_decode_with_x64(backend: str) -> None:
    with jax.enable_x64(True):
        inputs = _inputs()
        kw = dict(num_heads=HEADS, qkv_features=F, dtype=jnp.float64, param_dtype=jnp.float64,
                  decode=True)
        theirs = nn.MultiHeadDotProductAttention(**kw)
        mine = nn.MultiHeadDotProductAttention(**kw, attention_fn=ours(backend))
        variables = theirs.init(jax.random.key(0), inputs)
        params = variables["params"]
        decoded = {}
        for name, module in (("theirs", theirs), ("mine", mine)):
            cache = variables["cache"]
            step = jax.jit(lambda cache, token, m=module: m.apply(
                {"params": params, "cache": cache}, token, mutable=["cache"]))
            outs = []
            for i in range(STEPS):
                out, updated = step(cache, inputs[:, i : i + 1])
                cache = updated["cache"]
                outs.append(out)
            decoded[name] = jnp.concatenate(outs, 1)
        _close(decoded["mine"], decoded["theirs"])


def test_nnx_autoregressive_decode_with_x64() -> None:
    with jax.enable_x64(True):
        inputs = _inputs()
        m = nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, qkv_features=F,
                                   dtype=jnp.float64, param_dtype=jnp.float64, decode=True,
                                   rngs=nnx.Rngs(0))
        m.init_cache((BATCH, STEPS, F), dtype=jnp.float64)
        m.attention_fn = _einsum_attention
        theirs = nnx.clone(m)
        m.attention_fn = ours(PRIMARY)
        mine = nnx.clone(m)
        step = nnx.jit(lambda m, token: m(token))
        got, want = [], []
        for t in range(STEPS):
            got.append(step(mine, inputs[:, t : t + 1]))
            want.append(step(theirs, inputs[:, t : t + 1]))
        _close(jnp.concatenate(got, 1), jnp.concatenate(want, 1))
        # And the steps are the causal self-attention of the whole sequence.
        full = nnx.jit(lambda m, x: m(x, decode=False, is_causal=True))(m, inputs)
        _close(jnp.concatenate(got, 1), full)


def test_complex_inputs_are_refused_naming_the_adapter_and_why() -> None:
    q = jnp.ones((2, 4, 2, 8), jnp.complex64)
    with pytest.raises(ValueError, match=r"^attn_backends_flax: query, key and value are "
                       r"complex64, and no registry backend computes complex attention: its "
                       r"softmax needs real logits"):
        ours("reference")(q, q, q)
    # A complex dtype= promotes real inputs to complex: refused the same way.
    real = jnp.ones((2, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"^attn_backends_flax: .* complex64"):
        ours("reference")(real, real, real, dtype=jnp.complex64)
