"""attn_backends_flax against flax's own attention, on both jax lines.

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
import warnings

import attn_backends as ab
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _flax_support import PRIMARY, REGISTRY, close, ours, x
from _support import Plugin, make_backend
from attn_backends import FallbackWarning, UnsupportedError, oracle
from attn_backends_flax import DENSE_PATH, FlaxAttention, FlaxSignature, attention_fn

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


def test_linen_sow_weights_are_flaxs_and_the_output_is_their_product() -> None:
    t, batch = 9, 2
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F)
    fn = ours()
    mine = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F, attention_fn=fn)
    inputs = x(22, batch, t, F)
    params = theirs.init(jax.random.key(0), inputs)["params"]
    # Causal and key padding, every row seeing key 0: flax's numbers are the contract's.
    valid = jnp.arange(t) < jnp.array([[t], [t - 4]])
    mask = nn.combine_masks(
        nn.make_causal_mask(inputs[..., 0]), nn.make_attention_mask(jnp.ones((batch, t)), valid)
    )
    weight = x(23, batch, t, F)

    def loss(module, params, inputs):
        out, sown = module.apply({"params": params}, inputs, mask=mask, sow_weights=True,
                                 mutable=["intermediates"])
        return jnp.sum(out * weight), (out, sown["intermediates"])

    grad = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)
    want_grads, (want, want_sown) = grad(theirs, params, inputs)
    with pytest.warns(FallbackWarning, match=r"sow_weights asks for the attention weights") as said:
        got_grads, (got, got_sown) = grad(mine, params, inputs)
        mine.apply({"params": params}, inputs, mask=mask, sow_weights=True,
                   mutable=["intermediates"])  # traced again: the same signature
    assert len(said) == 1, [str(w.message) for w in said]
    assert jax.tree.structure(got_sown) == jax.tree.structure(want_sown)
    (weights,) = got_sown["attention_weights"]
    assert weights.shape == (batch, HEADS, t, t)
    close(got_sown, want_sown, atol=2e-6)
    close(got, want, atol=2e-6)
    close(got_grads, want_grads, atol=5e-5)
    # Without sow_weights the same module goes to the registry again.
    mine.apply({"params": params}, inputs, mask=mask)
    assert sorted(fn.served.values()) == sorted([DENSE_PATH, PRIMARY])


class _Attend(nn.Module):
    """A linen module that calls ``fn`` as flax's attention modules do, sowing."""

    fn: FlaxAttention

    @nn.compact
    def __call__(self, q, k, v, bias, mask):
        return self.fn(q, k, v, bias=bias, mask=mask, module=self)


def test_sown_weights_follow_the_contract_and_give_the_output() -> None:
    lead = (2, 3)
    q, k, v = x(24, *lead, 5, 4, 8), x(25, *lead, 7, 4, 8), x(26, *lead, 7, 4, 6)
    bias = x(27, *lead, 1, 5, 7)
    mask = np.random.default_rng(28).uniform(size=(4, 5, 7)) > 0.3
    mask[..., 0] = True
    mask[1, 2] = False  # head 1, query 2 sees no key: zeros here, flax's mean of v
    with pytest.warns(FallbackWarning, match="dense path"):
        out, sown = jax.jit(lambda *a: _Attend(ours()).apply({}, *a, mutable=["intermediates"]))(
            q, k, v, bias, mask
        )
    (weights,) = sown["intermediates"]["attention_weights"]
    assert weights.shape == (*lead, 4, 5, 7) and out.shape == (*lead, 5, 4, 6)
    w64, v64 = np.asarray(weights, np.float64), np.asarray(v, np.float64)
    np.testing.assert_allclose(out, np.einsum("...hqk,...khd->...qhd", w64, v64), atol=1e-6)
    assert not np.any(w64[..., 1, 2, :]) and not np.any(np.asarray(out)[..., 2, 1, :])
    flat = [np.asarray(a, np.float64).reshape(6, *a.shape[2:]) for a in (q, k, v)]
    want, _ = oracle.attention(*flat, mask=mask[None], bias=np.asarray(bias).reshape(6, 1, 5, 7))
    close(out, want.reshape(out.shape), atol=2e-6)
    want_weights = nn.dot_product_attention_weights(q, k, bias=bias, mask=mask)
    seen = np.broadcast_to(mask.any(-1)[..., None], weights.shape)
    close(np.where(seen, weights, 0), np.where(seen, want_weights, 0), atol=2e-6)


def test_the_dense_path_follows_the_attentions_fallback_policy() -> None:
    q = x(29, 1, 4, 2, 8)
    for fallback, expect in (("silent", None), ("error", UnsupportedError)):
        fn = attention_fn(REGISTRY.get(device="cpu", backend="reference", fallback=fallback))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "silent": no warning at all
            if expect is None:
                _Attend(fn).apply({}, q, q, q, None, None, mutable=["intermediates"])
            else:
                with pytest.raises(expect, match=r"fallback='error'.*drop sow_weights"):
                    _Attend(fn).apply({}, q, q, q, None, None, mutable=["intermediates"])


def test_sown_weights_with_dropout_are_refused_with_the_reason() -> None:
    q = x(31, 1, 4, 2, 8)

    class _AttendDropping(nn.Module):
        @nn.compact
        def __call__(self, q):
            return ours()(q, q, q, module=self, dropout_rate=0.1, deterministic=False,
                          dropout_rng=jax.random.key(0))

    with pytest.raises(NotImplementedError, match=r"sow_weights=True with attention dropout"):
        _AttendDropping().apply({}, q, mutable=["intermediates"])


def test_served_and_explain_name_the_backend_of_each_linen_signature() -> None:
    fn = ours()
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F, attention_fn=fn)
    assert "no call served yet" in str(fn.explain())
    inputs = x(30, 2, 3, 9, F)  # two batch dims: the contract call has B = 6
    params = module.init(jax.random.key(0), inputs)
    short = inputs[:, :, :5]
    jax.jit(module.apply)(params, inputs)
    jax.jit(module.apply)(params, short)
    jax.jit(module.apply)(params, short)  # a signature seen before: recorded once
    head = F // HEADS
    assert fn.served == {
        FlaxSignature((2, 3, 9, HEADS, head), (2, 3, 9, HEADS, head), (2, 3, 9, HEADS, head),
                      "float32"): PRIMARY,
        FlaxSignature((2, 3, 5, HEADS, head), (2, 3, 5, HEADS, head), (2, 3, 5, HEADS, head),
                      "float32"): PRIMARY,
    }
    served = fn.explain().calls
    assert [(c.call.batch, c.call.q_len) for c in served] == [(6, 9), (6, 5)]
    assert [c.explanations[0].chosen for c in served] == [PRIMARY, PRIMARY]
    text = str(fn.explain())
    assert "flax call: query[2,3,9,4,8]" in text and "contract call: q[6,9,4,8]" in text
    assert "batch dims [2, 3] flattened into B=6" in text and "CHOSEN" in text


def test_served_names_each_platforms_backend_for_an_export() -> None:
    one_each = ab.Registry(plugins=[Plugin(make_backend("on_cpu", platforms=("cpu",)),
                                           make_backend("on_tpu", platforms=("tpu",)))],
                           autoload=False, probe=None)
    fn = attention_fn(one_each.get(device=["cpu", "tpu"]))
    q = jax.ShapeDtypeStruct((2, 16, 2, 8), jnp.float32)
    jax.eval_shape(lambda q: fn(q, q, q, is_causal=True), q)  # traced, never lowered
    [(signature, backend)] = fn.served.items()
    assert signature.is_causal and backend == "cpu=on_cpu, tpu=on_tpu"
    assert [e.platform for e in fn.explain().calls[0].explanations] == ["cpu", "tpu"]


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(TypeError, match="not both"):
        attention_fn(REGISTRY.get(device="cpu"), device="cpu")
    with pytest.raises(TypeError, match="expected an attn_backends.Attention"):
        attention_fn(nn.dot_product_attention)
    with pytest.raises(ValueError, match=r"layout='BHTD'.*default layout='BTNH'"):
        attention_fn(device="cpu", layout="BHTD")
    q = x(21, 2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"mask: shape \[3, 4, 4\] does not broadcast"):
        ours("reference")(q, q, q, mask=jnp.ones((3, 4, 4), bool))


def test_core_imports_without_flax() -> None:
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "import attn_backends, attn_backends_flax\n"
        "print(attn_backends_flax.attention_fn.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "attention_fn"
