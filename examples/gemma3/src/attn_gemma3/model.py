"""Gemma 3's text decoder in JAX, with attention left to the caller.

``decoder`` runs the layers over a flat list of token rows ``[T]`` and calls
``attend(layer, q, k, v)`` for each layer's attention: the dense prefill passes
the registry's ``Attention`` (causal, the layer's window), the serving engine
the registry's ``PagedAttention`` over that layer's cache. Nothing of the
attention itself is computed here.

Per layer (transformers' ``Gemma3DecoderLayer`` and llama.cpp's ``gemma3``
graph agree): ``x += post_attn_norm(attn(attn_norm(x)))`` with RMSNorm on q and
k over the head dim before RoPE (rotate-half, the layer kind's base);
``x += post_ffn_norm(down(gelu_tanh(gate(h)) * up(h)))`` with ``h =
ffn_norm(x)``. Embeddings are scaled by ``sqrt(d_model)``; the output head is
the embedding (tied). The residual stream, norms and RoPE are float32; the
projections take the weights' dtype (float32 or bfloat16) and accumulate in
float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .weights import Config

#: attend(layer, q [T, heads, head_dim], k, v [T, kv_heads, head_dim]) -> [T, heads, head_dim]
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x ``[..., n]`` float32 normalised over its last axis, times ``weight`` ``[n]``
    (stored as ``1 + w`` in the GGUF: used as it is)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotate-half RoPE over the whole head dim: x ``[T, heads, head_dim]``,
    positions ``[T]``; dims i and i + head_dim/2 form a pair."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]       # [T, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _project(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def decoder(params: dict[str, Any], cfg: Config, tokens: jax.Array, positions: jax.Array,
            attend: Attend) -> jax.Array:
    """tokens, positions ``[T]`` int32 -> the final normed hidden states ``[T, d_model]``
    float32. ``attend`` gets q, k and v in the weights' dtype."""
    embed = params["embed"]
    x = jnp.take(embed, tokens, axis=0).astype(jnp.float32) * jnp.float32(cfg.d_model ** 0.5)
    dtype = embed.dtype
    t = tokens.shape[0]
    for layer, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"], cfg.eps)
        q = _project(h, p["wq"]).reshape(t, cfg.heads, cfg.head_dim)
        k = _project(h, p["wk"]).reshape(t, cfg.kv_heads, cfg.head_dim)
        v = _project(h, p["wv"]).reshape(t, cfg.kv_heads, cfg.head_dim)
        base = cfg.rope_global if cfg.is_global(layer) else cfg.rope_local
        q = rope(rms_norm(q, p["q_norm"], cfg.eps), positions, base)
        k = rope(rms_norm(k, p["k_norm"], cfg.eps), positions, base)
        out = attend(layer, q.astype(dtype), k.astype(dtype), v.astype(dtype))
        out = _project(out.reshape(t, cfg.heads * cfg.head_dim), p["wo"])
        x = x + rms_norm(out, p["post_attn_norm"], cfg.eps)
        h = rms_norm(x, p["ffn_norm"], cfg.eps)
        ff = jax.nn.gelu(_project(h, p["w_gate"]), approximate=True) * _project(h, p["w_up"])
        x = x + rms_norm(_project(ff, p["w_down"]), p["post_ffn_norm"], cfg.eps)
    return rms_norm(x, params["final_norm"], cfg.eps)


def logits_of(params: dict[str, Any], hidden: jax.Array) -> jax.Array:
    """hidden ``[N, d_model]`` -> logits ``[N, vocab]`` float32 (the tied head)."""
    embed = params["embed"]
    # One row is a matrix-vector product: on jax 0.12.1 it reads the head at
    # 45 GB/s in float32 (15 ms; two rows take the matrix path, 25 ms) and no
    # longer widens a bfloat16 head first (0.12.0.1 did, hence pyproject's jax
    # floor: BENCHMARKS.md, Gemma 3).
    return jax.lax.dot_general(hidden.astype(embed.dtype), embed, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


#: The greedy pick reads the logits in blocks of this many (a divisor of the vocabulary).
PICK_BLOCK = 512


def first_largest(values: jax.Array, axis: int) -> jax.Array:
    """The first index of the largest value along ``axis`` (int32), as ``jnp.argmax``
    (ties to the first, a NaN the largest): two plain reductions, the max and then
    the least index holding it, which XLA's CPU code vectorizes (its argmax
    reduces (value, index) pairs: 6x slower over 16 rows of 262,144)."""
    largest = jnp.max(values, axis=axis, keepdims=True)  # NaN where a NaN is
    index = jax.lax.broadcasted_iota(jnp.int32, values.shape, axis % values.ndim)
    holds = (values == largest) | jnp.isnan(values)
    return jnp.min(jnp.where(holds, index, values.shape[axis]), axis=axis)


def greedy(logits: jax.Array, axis: int = -1) -> jax.Array:
    """logits ``[N, vocab]`` (axis -1) or ``[vocab, N]`` (axis 0) -> each row's greedy
    token ``[N]`` int32, the first index of its largest logit (``jnp.argmax``).

    In two passes over blocks of :data:`PICK_BLOCK`: the block holding the
    first largest, then the first largest inside it. Measured in a float32
    decode step of 16 rows (the engine's program, XLA's CPU code): 50 ms
    against 61 ms with one pass over the whole vocabulary (BENCHMARKS.md,
    issue 58)."""
    vocab = logits.shape[axis]
    if vocab % PICK_BLOCK:
        return first_largest(logits, axis)
    rows = jnp.arange(logits.shape[1 - axis % 2])
    if axis % 2:                                            # [N, vocab]
        blocks = logits.reshape(-1, vocab // PICK_BLOCK, PICK_BLOCK)
        block = first_largest(jnp.max(blocks, axis=2), axis=1)
        inside = blocks[rows, block]                        # [N, PICK_BLOCK]
    else:                                                   # [vocab, N]
        blocks = logits.reshape(vocab // PICK_BLOCK, PICK_BLOCK, -1)
        block = first_largest(jnp.max(blocks, axis=1), axis=0)
        inside = blocks[block, :, rows]                     # [N, PICK_BLOCK]
    return block * PICK_BLOCK + first_largest(inside, axis=1)


def next_tokens(params: dict[str, Any], hidden: jax.Array) -> jax.Array:
    """hidden ``[N, d_model]`` -> the greedy next token of each row ``[N]`` int32."""
    embed = params["embed"]
    if embed.dtype == jnp.float32 and hidden.shape[0] > 1:
        # XLA's CPU product of a float32 head with several rows is faster as
        # [vocab, N] (the head on the left): 16 rows in 27 ms against 36 ms as
        # [N, vocab]; in bfloat16 the other way round (20 against 17 ms).
        logits = jax.lax.dot_general(embed, hidden, (((1,), (1,)), ((), ())))
        return greedy(logits, axis=0)
    return greedy(logits_of(params, hidden))


def window_of(cfg: Config, layer: int) -> int | None:
    """How many keys before a query its layer sees (None: all, a global layer):
    the GGUF's sliding window of 512 keys is the query's own and 511 before it."""
    return None if cfg.is_global(layer) else cfg.window - 1
