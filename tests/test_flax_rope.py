"""flax 0.12.12's ``input_positions``: RoPE through ``attention_fn(rope=...)``, refused without.

``nnx.MultiHeadAttention(x, input_positions=...)`` hands the positions to its
``attention_fn``; flax's ``nnx.dot_product_attention_with_rope`` rotates query
and key by an ``nnx.RoPE`` there. The adapter does the same with ``rope=``,
judged against flax's own function (positions left to the RoPE) and against
flax's own ``nnx.RoPE`` and ``nnx.dot_product_attention`` per row (positions
given: flax's function raises then, the finding below); without ``rope`` the
positions are refused, never dropped. flax 0.12.8 (the jax 0.10 line) has no
``nnx.RoPE``: make test runs this file on the newest line.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from _flax_support import PRIMARY, REGISTRY, close, ours, x
from attn_backends_flax import attention_fn
from flax import nnx

F, HEADS, T = 32, 4, 6


def _module(attention: object) -> nnx.MultiHeadAttention:
    """One nnx attention layer (the same weights every time) with ``attention``."""
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, qkv_features=F, decode=False,
                                  attention_fn=attention, rngs=nnx.Rngs(0))


def _flax_rotated_attention(rope: nnx.RoPE, q: jax.Array, k: jax.Array, v: jax.Array,
                            positions: jax.Array) -> jax.Array:
    """flax's own RoPE on each row's every head at that row's positions, then flax's own
    attention: [B, T, H, D] -> [B, T, H, D]."""
    def rotate(x: jax.Array) -> jax.Array:
        return jnp.stack([jnp.stack([rope(x[b, :, h], positions[b]) for h in range(x.shape[2])],
                                    axis=1) for b in range(x.shape[0])])

    return nnx.dot_product_attention(rotate(q), rotate(k), v)


# flax 0.12.12's RoPE reads its cached tables by ``.value``, which the same flax
# deprecates (a DeprecationWarning from flax's own code, on either side here).
CACHED_TABLES_WARN = pytest.mark.filterwarnings(
    "ignore:'.value' access is now deprecated:DeprecationWarning")


@pytest.mark.parametrize("cached", [pytest.param(True, marks=CACHED_TABLES_WARN), False],
                         ids=["cached-tables", "no-tables"])
def test_rope_without_positions_is_flaxs_dot_product_attention_with_rope(cached: bool) -> None:
    """Positions left to the RoPE: forward and gradient w.r.t. the input equal
    flax's own ``nnx.dot_product_attention_with_rope`` on the same module."""
    rope = nnx.RoPE(embedding_size=F // HEADS, max_seq_len=16) if cached else nnx.RoPE()
    theirs = _module(functools.partial(nnx.dot_product_attention_with_rope, rope=rope))
    mine = _module(attention_fn(REGISTRY.get(device="cpu", backend=PRIMARY), rope=rope))
    inputs = x(0, 2, T, F)
    close(mine(inputs), theirs(inputs), atol=2e-5)
    grads = [jax.grad(lambda v, m=m: m(v).sum())(inputs) for m in (mine, theirs)]
    close(grads[0], grads[1], atol=2e-4)


def test_rope_at_positions_is_flaxs_rope_then_flaxs_attention() -> None:
    """Per-row positions ``[B, T]`` (spaced differently per row: RoPE's scores see
    position differences only, so a per-row offset alone would not show) and shared
    ones ``[T]``: the adapter's output equals flax's RoPE then flax's attention,
    and differs from the same call at positions 0, 3, 6, ... (the positions are
    used; a common offset would not show, RoPE's scores see differences only)."""
    rope = nnx.RoPE()
    q, k, v = x(1, 2, T, HEADS, 8), x(2, 2, T, HEADS, 8), x(3, 2, T, HEADS, 8)
    fn = ours(PRIMARY)
    fn.rope = rope
    for positions in (jnp.stack([jnp.arange(T) + 5, jnp.arange(T) * 2 + 11]).astype(jnp.float32),
                      jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32) + 7, (2, T))):
        got = fn(q, k, v, input_positions=positions)
        close(got, _flax_rotated_attention(rope, q, k, v, positions), atol=2e-5)
    shared = fn(q, k, v, input_positions=jnp.arange(T, dtype=jnp.float32) + 7)
    close(shared, got, atol=0, rtol=0)
    spread = fn(q, k, v, input_positions=jnp.arange(T, dtype=jnp.float32) * 3)
    assert float(jnp.abs(spread - got).max()) > 1e-2


def test_multi_head_attention_passes_positions_through_to_the_rope() -> None:
    """What flax 0.12.12's module does with ``input_positions``: the adapter gets them
    and rotates by them (the same as flax's RoPE then attention on the module's own
    projections, checked through the layer's output)."""
    rope = nnx.RoPE()
    layer = _module(attention_fn(REGISTRY.get(device="cpu", backend=PRIMARY), rope=rope))
    inputs = x(4, 2, T, F)
    positions = jnp.stack([jnp.arange(T) + 3, jnp.arange(T) * 2 + 9]).astype(jnp.float32)
    got = layer(inputs, input_positions=positions)
    q, k, v = (getattr(layer, name)(inputs) for name in ("query", "key", "value"))
    want = layer.out(_flax_rotated_attention(rope, q, k, v, positions))
    close(got, want, atol=2e-5)


def test_positions_without_a_rope_are_refused_by_name() -> None:
    """A plain attention_fn given positions raises, naming input_positions and rope=,
    rather than attending as if there were none."""
    layer = _module(ours(PRIMARY))
    with pytest.raises(TypeError, match=r"input_positions.*attention_fn\(\.\.\., rope=nnx.RoPE"):
        layer(x(5, 1, T, F), input_positions=jnp.arange(T, dtype=jnp.float32))


def test_positions_of_the_wrong_length_are_a_value_error() -> None:
    fn = attention_fn(REGISTRY.get(device="cpu", backend=PRIMARY), rope=nnx.RoPE())
    q = x(6, 1, T, HEADS, 8)
    with pytest.raises(ValueError, match=r"input_positions \[5\]"):
        fn(q, q, q, input_positions=jnp.arange(5, dtype=jnp.float32))


def test_finding_flaxs_own_rope_attention_raises_at_positions() -> None:
    """The finding behind the per-row reference above (flax 0.12.12): its
    ``dot_product_attention_with_rope`` maps ``input_positions`` over the heads
    axis (``vmap(rope, in_axes=(-2, -1))``), so given positions it raises unless
    the head count equals T. When this fails, flax fixed it: compare with its
    function directly."""
    q = x(7, 1, T, HEADS, 8)
    with pytest.raises(ValueError, match="inconsistent sizes"):
        nnx.dot_product_attention_with_rope(q, q, q, rope=nnx.RoPE(),
                                            input_positions=jnp.arange(T, dtype=jnp.float32))
