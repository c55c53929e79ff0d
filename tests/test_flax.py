"""attn_backends.flax against flax's own attention, on both jax lines.

flax.linen's MultiHeadDotProductAttention with flax's attention and with the
adapter, on the same parameters: forward, gradients w.r.t. parameters and
inputs, KV-cache decoding step by step. The function itself against
``jax.nn.dot_product_attention`` (what flax's own nnx attention runs):
``is_causal`` in all three Tq/Tk relations, GQA, bias, masks, batch dims,
dtype. nnx modules: test_flax_nnx.py.
"""

from __future__ import annotations

import subprocess
import sys

import attn_backends as ab
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _flax_support import PRIMARY, REGISTRY, close, ours, x
from attn_backends.flax import attention_fn

F, HEADS = 32, 4


def test_linen_forward_grads_and_decoding_match_flax() -> None:
    t, batch = 9, 2
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F)
    mine = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F, attention_fn=ours())
    inputs = x(5, batch, t, F)
    params = theirs.init(jax.random.key(0), inputs)["params"]
    # Causal and key padding: every query row sees key 0, so flax's numbers
    # and the contract's agree everywhere (rows that see no key do not).
    valid = jnp.arange(t) < jnp.array([[t], [t - 4]])
    mask = nn.combine_masks(
        nn.make_causal_mask(inputs[..., 0]), nn.make_attention_mask(jnp.ones((batch, t)), valid)
    )
    weight = x(6, batch, t, F)

    def loss(module, params, inputs):
        out = module.apply({"params": params}, inputs, mask=mask)
        return jnp.sum(out * weight), out

    grad = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)
    want_grads, want = grad(theirs, params, inputs)
    got_grads, got = grad(mine, params, inputs)
    close(got, want, atol=2e-6)
    close(got_grads, want_grads, atol=5e-5)

    decoded = {}
    for name, module in (("theirs", theirs.clone(decode=True)), ("mine", mine.clone(decode=True))):
        cache = module.init(jax.random.key(0), inputs)["cache"]
        step = jax.jit(
            lambda cache, token, m=module: m.apply(
                {"params": params, "cache": cache}, token, mutable=["cache"]
            )
        )
        outs = []
        for i in range(t):
            out, variables = step(cache, inputs[:, i : i + 1])
            cache = variables["cache"]
            outs.append(out)
        decoded[name] = jnp.concatenate(outs, 1)
    close(decoded["mine"], decoded["theirs"], atol=2e-6)


def _jnn(q, k, v, **kwargs):
    return jax.jit(lambda *a: jax.nn.dot_product_attention(*a, **kwargs))(q, k, v)


def _mine(q, k, v, backend=PRIMARY, **kwargs):
    return jax.jit(lambda *a: ours(backend)(*a, **kwargs))(q, k, v)


@pytest.mark.parametrize("tq, tk", [(7, 7), (5, 11), (11, 5)], ids=["tq=tk", "tq<tk", "tq>tk"])
def test_is_causal_is_flax_top_left_causal_forward_and_grads(tq: int, tk: int) -> None:
    # GQA 4:2; the oracle repeats kv heads itself.
    q, k, v = x(7, 2, tq, 4, 8), x(8, 2, tk, 2, 8), x(9, 2, tk, 2, 8)
    weight = x(10, 2, tq, 4, 8)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, is_causal=True) * weight)

    got = jax.jit(jax.value_and_grad(loss(ours()), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2)))(
        q, k, v
    )
    close(got, want, atol=5e-5)


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["no-batch-dims", "two-batch-dims"])
def test_bias_float_mask_and_batch_dims_match_flax(lead: tuple[int, ...]) -> None:
    q, k, v = x(11, *lead, 5, 4, 8), x(12, *lead, 7, 4, 8), x(13, *lead, 7, 4, 8)
    bias = x(14, *lead, 1, 5, 7)
    mask = (np.random.default_rng(15).uniform(size=(4, 5, 7)) > 0.3).astype(np.float32)
    mask[..., 0] = 1.0  # every row sees a key: flax's and the contract's agree
    want = jax.jit(lambda *a: nn.dot_product_attention(*a, bias=bias, mask=mask))(q, k, v)
    got = _mine(q, k, v, bias=bias, mask=mask)
    assert got.shape == (*lead, 5, 4, 8)
    close(got, want, atol=2e-6)


def test_a_row_that_sees_no_key_gives_zeros_where_flax_averages() -> None:
    q = x(16, 1, 3, 2, 8)
    mask = jnp.array([True, False, True])[:, None] * jnp.ones((3, 3), bool)
    got = _mine(q, q, q, mask=mask)
    want = jax.jit(lambda *a: nn.dot_product_attention(*a, mask=mask))(q, q, q)
    close(got[:, ::2], want[:, ::2], atol=2e-6)
    assert not np.any(np.asarray(got[:, 1])) and np.all(np.asarray(want[:, 1]) != 0)


def test_dtype_promotes_like_flax() -> None:
    q, k, v = x(17, 2, 6, 4, 8), x(18, 2, 6, 4, 8), x(19, 2, 6, 4, 8)
    want = jax.jit(lambda *a: nn.dot_product_attention(*a, dtype=jnp.bfloat16))(q, k, v)
    got = _mine(q, k, v, dtype=jnp.bfloat16)
    assert got.dtype == want.dtype == jnp.bfloat16
    close(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "backend", [b for b in ("reference", "xla_native") if b in REGISTRY.backends]
)
def test_linen_dropout_follows_the_rng(backend: str) -> None:
    """As flax's test_multihead_self_attention_w_dropout: the same dropout rng gives the
    same output, another rng another; deterministic=True is flax's attention, no dropout."""
    inputs = x(20, 2, 12, F)
    mine = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=F, dropout_rate=0.5, attention_fn=ours(backend)
    )
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F, dropout_rate=0.5)
    params = theirs.init(jax.random.key(0), inputs, deterministic=True)
    run = jax.jit(lambda rng: mine.apply(params, inputs, deterministic=False,
                                         rngs={"dropout": rng}))
    # Linen's rngs may be raw uint32[2] keys or typed ones: both are served.
    a, b, c = run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(2))
    assert np.array_equal(a, b)
    assert not np.allclose(a, c, atol=1e-3)
    plain = mine.apply(params, inputs, deterministic=True)
    close(plain, theirs.apply(params, inputs, deterministic=True), atol=2e-6)
    assert not np.allclose(a, plain, atol=1e-3)
    assert np.array_equal(run(jax.random.key(1)), run(jax.random.key(1)))


def test_dropout_equals_the_oracle_under_the_backends_mask() -> None:
    """Batch dims are flattened into the contract's B: the adapter's dropout is the
    float64 oracle's under the keep-mask the backend exposes for the flat call."""
    from attn_backends import oracle

    q, k, v = x(22, 2, 3, 10, 4, 8), x(23, 2, 3, 10, 4, 8), x(24, 2, 3, 10, 4, 8)
    rng = jax.random.key(5)
    got = jax.jit(lambda q, k, v: ours()(q, k, v, dropout_rate=0.3, dropout_rng=rng,
                                         deterministic=False))(q, k, v)
    flat = [np.asarray(a).reshape(6, 10, 4, 8) for a in (q, k, v)]
    call, _ = ab.bind(*flat, dropout_rate=0.3, dropout_key=rng)
    keep = np.asarray(REGISTRY.backend(PRIMARY).dropout_keep(call, rng))
    want, _ = oracle.attention(*flat, dropout_rate=0.3, dropout_keep=keep)
    close(np.asarray(got).reshape(6, 10, 4, 8), want, atol=2e-6)


def test_linen_sow_weights_is_refused_with_the_reason() -> None:
    inputs = x(20, 1, 4, F)
    mine = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=F, attention_fn=ours("reference")
    )
    params = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F).init(
        jax.random.key(0), inputs
    )
    with pytest.raises(NotImplementedError, match="sow_weights=True"):
        mine.apply(params, inputs, deterministic=True, sow_weights=True, mutable=["intermediates"])


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(TypeError, match="not both"):
        attention_fn(REGISTRY.get(device="cpu"), device="cpu")
    with pytest.raises(TypeError, match="expected an attn_backends.Attention"):
        attention_fn(nn.dot_product_attention)
    q = x(21, 2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"mask: shape \[3, 4, 4\] does not broadcast"):
        ours("reference")(q, q, q, mask=jnp.ones((3, 4, 4), bool))


def test_core_imports_without_flax() -> None:
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "import attn_backends, attn_backends.flax\n"
        "print(attn_backends.flax.attention_fn.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "attention_fn"
