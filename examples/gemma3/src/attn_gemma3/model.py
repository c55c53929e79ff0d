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
    rows = hidden.shape[0]
    if rows == 1:
        # XLA's CPU matrix-vector product of bfloat16 widens the whole 262,144 x 640
        # matrix to float32 first (641 MiB of temporaries, 9x slower than two rows:
        # BENCHMARKS.md, Gemma 3); a second row takes the matrix path.
        hidden = jnp.concatenate([hidden, hidden])
    logits = jax.lax.dot_general(hidden.astype(embed.dtype), embed, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    return logits[:rows]


def window_of(cfg: Config, layer: int) -> int | None:
    """How many keys before a query its layer sees (None: all, a global layer):
    the GGUF's sliding window of 512 keys is the query's own and 511 before it."""
    return None if cfg.is_global(layer) else cfg.window - 1
