"""attn_backends_flax in flax.nnx, against flax's own attention on the same module and weights.

Forward, gradients w.r.t. parameters and inputs, KV-cache decoding step by
step, GQA (``num_kv_heads``), ``is_causal`` both ways round, float masks and
attention dropout. Runs on both jax lines (``make test`` runs it in each):
flax 0.12.8 on jax 0.10, flax 0.12.12 on jax 0.12 (0.12.8's nnx does not
import on jax 0.12: it subclasses ``jax.experimental.hijax.HiPrimitive``,
renamed ``HiPrim`` there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from _docs import code_block
from _flax_support import BACKENDS, PRIMARY, close, ours, x
from attn_backends import FallbackWarning
from attn_backends_flax import DENSE_PATH
from flax import nnx

F, HEADS = 32, 4


@functools.cache
def _initialised(num_kv_heads: int | None) -> tuple[nnx.GraphDef, nnx.State]:
    # Initialised once: each initialiser compiles its own random program.
    return nnx.split(nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=F, qkv_features=F, num_kv_heads=num_kv_heads,
        decode=False, rngs=nnx.Rngs(0),
    ))


PLATFORMS_PAGE = "docs/guides/platforms.md"


def _module(num_kv_heads: int | None = None) -> nnx.MultiHeadAttention:
    """A fresh nnx module with flax's attention and the same weights as every other."""
    return nnx.merge(*_initialised(num_kv_heads))


def _nnx_pair(backend: str, num_kv_heads: int | None):
    """One nnx module's graph with flax's attention and with ours, and its state."""
    m = _module(num_kv_heads)
    flax_graph, state = nnx.split(m)
    m.attention_fn = ours(backend)
    our_graph, _ = nnx.split(m)
    return flax_graph, our_graph, state


# (Tq, Tk, is_causal, padding mask, kv heads): top-left causal cross-attention
# (all three Tq/Tk relations are in test_flax.py); a float padding mask as
# flax's make_attention_mask builds it; GQA self-attention, causal and padded.
NNX_CASES = {
    "causal-tq<tk": (6, 11, True, False, None),
    "float-mask": (9, 9, False, True, None),
    "gqa-causal-mask": (9, 9, True, True, 2),
}


@pytest.mark.parametrize(
    ("case", "backend"),
    [(case, PRIMARY) for case in NNX_CASES]
    + [("gqa-causal-mask", b) for b in BACKENDS if b != PRIMARY],
)
def test_nnx_forward_and_grads_match_flax(case: str, backend: str) -> None:
    tq, tk, is_causal, padded, kv_heads = NNX_CASES[case]
    flax_graph, our_graph, state = _nnx_pair(backend, kv_heads)
    xq, xkv = x(1, 2, tq, F), x(2, 2, tk, F)
    mask = None
    if padded:
        valid = jnp.arange(tk) < jnp.array([[tk], [tk - 3]])
        mask = nnx.make_attention_mask(jnp.ones((2, tq)), valid, dtype=jnp.float32)
    weight = x(3, 2, tq, F)

    def loss(graph, state, xq, xkv):
        out = nnx.merge(graph, state)(xq, xkv, mask=mask, is_causal=is_causal)
        return jnp.sum(out * weight), out

    grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
    want_grads, want = jax.jit(grad, static_argnums=0)(flax_graph, state, xq, xkv)
    got_grads, got = jax.jit(grad, static_argnums=0)(our_graph, state, xq, xkv)
    close(got, want, atol=2e-6)
    close(got_grads, want_grads, atol=5e-5)


def test_nnx_kv_cache_decoding_matches_flax_step_by_step() -> None:
    steps, batch = 7, 2
    m = _module(2)
    m.decode = True
    m.init_cache((batch, steps, F))
    inputs = x(4, batch, steps, F)
    theirs = nnx.clone(m)
    m.attention_fn = ours(PRIMARY)
    mine = nnx.clone(m)
    step = nnx.jit(lambda m, token: m(token))
    got, want = [], []
    for t in range(steps):
        got.append(step(mine, inputs[:, t : t + 1]))
        want.append(step(theirs, inputs[:, t : t + 1]))
    close(jnp.concatenate(got, 1), jnp.concatenate(want, 1), atol=2e-6)
    # And the steps are the causal self-attention of the whole sequence.
    full = nnx.jit(lambda m, x: m(x, decode=False, is_causal=True))(m, inputs)
    close(jnp.concatenate(got, 1), full, atol=2e-6)



@pytest.mark.parametrize("backend", [b for b in ("reference", "xla_native") if b in BACKENDS])
def test_dropout_follows_the_rng_and_deterministic_drops_nothing(backend: str) -> None:
    """As flax's test_multihead_self_attention_w_dropout (and ..._explicit_dropout):
    the same rng gives the same output, another rng another; deterministic=True
    is flax's own attention without dropout."""
    m = _module()
    m.dropout_rate, m.attention_fn = 0.5, ours(backend)
    inputs = x(15, 2, 12, F)
    a = m(inputs, deterministic=False, rngs=nnx.Rngs(dropout=1))
    b = m(inputs, deterministic=False, rngs=nnx.Rngs(dropout=1))
    c = m(inputs, deterministic=False, rngs=nnx.Rngs(dropout=2))
    assert jnp.array_equal(a, b)
    assert not jnp.allclose(a, c, atol=1e-3)
    got = m(inputs, deterministic=True)
    assert not jnp.allclose(a, got, atol=1e-3)
    m.attention_fn = nnx.dot_product_attention
    close(got, m(inputs, deterministic=True), atol=2e-6)


@pytest.mark.parametrize("tq, tk", [(6, 11), (11, 6)], ids=["tq<tk", "tq>tk"])
def test_nnx_sow_weights_are_flaxs_with_gqa_and_top_left_causal(tq: int, tk: int) -> None:
    # Top-left causal cross-attention both ways round, GQA 4:2: flax's own
    # weights and output are the oracle (every row sees key 0, so they agree).
    flax_graph, our_graph, state = _nnx_pair(PRIMARY, 2)
    xq, xkv = x(5, 2, tq, F), x(6, 2, tk, F)
    weight = x(7, 2, tq, F)

    def loss(graph, state, xq, xkv):
        # nnx.capture: flax's way to collect what a module sows.
        forward = nnx.capture(nnx.merge(graph, state), nnx.Intermediate)
        out, sown = forward(xq, xkv, is_causal=True, sow_weights=True)
        return jnp.sum(out * weight), (out, sown)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    want_grads, (want, want_sown) = grad(flax_graph, state, xq, xkv)
    with pytest.warns(FallbackWarning, match="dense path"):
        got_grads, (got, got_sown) = grad(our_graph, state, xq, xkv)
    (weights,) = got_sown["attention_weights"]
    assert weights.shape == (2, HEADS, tq, tk)
    close(got_sown, want_sown, atol=2e-6)
    close(got, want, atol=2e-6)
    close(got_grads, want_grads, atol=5e-5)


def test_nnx_served_and_explain_say_what_each_signature_became() -> None:
    m = _module(2)
    fn = m.attention_fn = ours(PRIMARY)
    xq, xkv = x(8, 2, 6, F), x(9, 2, 11, F)
    step = nnx.jit(lambda m, xq, xkv: m(xq, xkv, is_causal=True))
    step(m, xq, xkv)
    step(m, xq, xkv)
    with pytest.warns(FallbackWarning, match="dense path"):
        nnx.jit(nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate))(m, xq)
    assert [(s.query[-3], s.key[-3], s.sow_weights, backend)
            for s, backend in fn.served.items()] == [(6, 11, False, PRIMARY),
                                                     (6, 6, True, DENSE_PATH)]
    causal, sown = fn.explain().calls
    # The contract call of top-left causal with Tq < Tk: keys cut to Tq, causal.
    assert (causal.call.kv_len, causal.call.causal, causal.call.kv_heads) == (6, True, 2)
    assert causal.explanations[0].chosen == PRIMARY and not sown.explanations
    text = str(fn.explain())
    assert "keys cut to the first 6, causal=True" in text
    assert f"served by: {PRIMARY}" in text and f"served by: {DENSE_PATH}" in text


def test_the_docs_flax_export_example_serialises_and_matches_flax() -> None:
    block = code_block(PLATFORMS_PAGE, "# example: export a flax module")
    scope: dict = {}
    exec(compile(block, f"{PLATFORMS_PAGE} (flax export)", "exec"), scope)
    restored = scope["restored"]
    assert restored.platforms == ("tpu", "cuda", "cpu")
    assert isinstance(scope["blob"], (bytes, bytearray))
    # flax's own attention on the same weights is the oracle.
    theirs = nnx.merge(scope["graphdef"], scope["state"])
    theirs.attention_fn = nnx.dot_product_attention
    want = theirs(scope["x"], is_causal=True)
    close(scope["out"], want, atol=2e-6)
    # The artifact stands alone: loaded again from bytes, it gives the same.
    again = jax.export.deserialize(bytes(scope["blob"])).call(scope["leaves"], scope["x"])
    close(again, want, atol=2e-6)
