"""What flax hands over that is rotated or refused before the contract call.

RoPE on query and key for ``input_positions``; refusals of quantized einsums
and complex dtypes, each saying why and what to do.

flax 0.12.12's ``nnx.MultiHeadAttention(x, input_positions=...)`` hands
``input_positions`` to its ``attention_fn``; only flax's
``nnx.dot_product_attention_with_rope`` reads them: it rotates query and key
by an ``nnx.RoPE`` at those positions, then attends. ``attention_fn(rope=...)``
does the same before the registry's attention; without ``rope`` the positions
are refused (:data:`NO_ROPE`), never dropped. Never imports flax: ``rope`` is
the user's module (any callable ``rope(x [..., T, D], positions [T] | None)``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

NO_ROPE = (
    "attn_backends_flax: flax passed input_positions (MultiHeadAttention(...)(x, "
    "input_positions=...)), which only a rotary embedding reads (flax's "
    "nnx.dot_product_attention_with_rope), but this attention_fn has no rope: build it with "
    "attention_fn(..., rope=nnx.RoPE(...)) to rotate query and key at those positions before "
    "the registry's attention, or call the module without input_positions."
)


def with_rope(rope: Any, query: jax.Array, key: jax.Array,
              positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """query ``[batch..., Tq, Hq, D]`` and key ``[batch..., Tk, Hkv, D]``, each head
    rotated by ``rope`` at ``positions`` (``[T]`` or ``[batch..., T]``, T = Tq = Tk).

    ``positions`` None: ``rope``'s own (an ``nnx.RoPE``'s cached tables, or
    ``0..T-1``), exactly as ``nnx.dot_product_attention_with_rope`` calls it.
    Either way the result has the dtype ``rope`` gives (float32 tables promote a
    bfloat16 query, as in flax's own function).
    Given, each batch row and head is rotated at its row's positions (flax
    0.12.12's own function maps the positions over the heads axis instead, and
    raises unless the head count equals T: docs/DESIGN.md's flax findings).
    """
    if positions is None:
        over_heads = jax.vmap(rope, in_axes=-2, out_axes=-2)
        return over_heads(query), over_heads(key)
    positions = jnp.asarray(positions)
    batch, length = query.shape[:-3], query.shape[-3]
    if key.shape[-3] != length or positions.shape[-1:] != (length,):
        raise ValueError(
            "attn_backends_flax: input_positions rotate query and key at the same positions: "
            f"expected query and key of one length T and positions [T] or [batch..., T]; got "
            f"query {list(query.shape)}, key {list(key.shape)}, input_positions "
            f"{list(positions.shape)}")
    try:
        positions = jnp.broadcast_to(positions, (*batch, length)).reshape((-1, length))
    except ValueError:
        raise ValueError(
            f"attn_backends_flax: input_positions {list(positions.shape)} do not broadcast to "
            f"query's batch dims and length {list((*batch, length))}") from None
    # One row's [T, H, D] per vmap over B; each head's [T, D] at that row's [T].
    rotate = jax.vmap(jax.vmap(rope, in_axes=(1, None), out_axes=1))

    def rotated(x: jax.Array) -> jax.Array:
        flat = x.reshape((-1, *x.shape[-3:]))
        rotated = rotate(flat, positions.astype(jnp.float32))
        return rotated.reshape((*x.shape[:-1], rotated.shape[-1]))

    return rotated(query), rotated(key)


def refuse_unsupported(qk_einsum: Any, value_einsum: Any) -> None:
    if qk_einsum is not None or value_einsum is not None:
        raise NotImplementedError(
            "attn_backends_flax: qk_attn_weights_einsum / attn_weights_value_einsum (quantized "
            "einsums) replace the matmuls inside attention, but the backend runs its own kernel. "
            "Leave them unset, or keep flax's own dot_product_attention for this module."
        )


def refuse_complex(dtype: Any) -> None:
    """flax's attention takes complex inputs; softmax attention over them is not defined."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(
            f"attn_backends_flax: query, key and value are {jnp.dtype(dtype).name}, and no "
            "registry backend computes complex attention: its softmax needs real logits (a "
            "maximum and exp of real numbers), which the contract defines only for float "
            "dtypes. Use real dtypes (float32, bfloat16, float16; float64 under "
            "jax_enable_x64), or keep flax's own dot_product_attention for a complex model."
        )
