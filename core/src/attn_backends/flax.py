"""A registry ``Attention`` as the ``attention_fn`` of flax's attention modules.

::

    from flax import nnx
    from attn_backends.flax import attention_fn

    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=512, num_kv_heads=2, decode=False,
        attention_fn=attention_fn(device="tpu"), rngs=nnx.Rngs(0),
    )

:func:`attention_fn` serves ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention`` (any caller of flax's
``dot_product_attention`` signature). This module never imports flax: it reads
only the arrays flax hands over, so ``attn_backends`` imports without flax
(``pip install "attn-backends[flax]"`` installs a tested flax).

What flax passes, and what becomes of it:

- query ``[batch..., Tq, Hq, D]``, key ``[batch..., Tk, Hkv, D]``, value
  ``[batch..., Tk, Hkv, Dv]``: any number of batch dims (none included) are
  flattened into the contract's one ``B``; ``Hkv < Hq`` (nnx's
  ``num_kv_heads``) is the contract's GQA.
- ``mask`` (bool or float, broadcastable to ``[batch..., Hq, Tq, Tk]``):
  cast to bool (nonzero = visible, as flax reads it) and broadcast to
  ``[B|1, Hq|1, Tq, Tk]``. ``bias``: broadcast the same way.
- ``is_causal`` is flax's (and ``jax.nn.dot_product_attention``'s) causal,
  aligned top-left: key j is visible to query i when ``j <= i``. The
  contract's ``causal`` is aligned bottom-right (``j <= i + Tk - Tq``). The
  two agree when ``Tq == Tk`` (self-attention), which is mapped to
  ``causal=True``. With ``Tq > Tk`` it becomes ``window=(None, Tq - Tk)``;
  with ``Tq < Tk`` keys ``j >= Tq`` are visible to no query, so key, value,
  mask and bias are cut to the first ``Tq`` keys and run with
  ``causal=True``. All three are exactly flax's numbers, and none needs a
  dense mask. KV-cache decoding (``decode=True``) needs no ``is_causal``:
  flax masks the cache itself (``arange(max_len) <= index``), which arrives
  here as ``mask``.
- ``dtype``: query, key and value are promoted to it (or to their common
  dtype), as flax does; the output has that dtype. Under ``jax_enable_x64``
  float64 modules run in float64 on a backend that claims it (reference,
  xla_native); complex dtypes are refused (softmax needs real logits).
- ``precision`` is not forwarded: each backend fixes its own matmul
  precision (softmax is float32 in every backend), as flax's own
  ``jax.nn.dot_product_attention`` path ignores it too.
  ``force_fp32_for_softmax`` (linen) is always true here.
- Refused, with an error saying why and what to do: attention dropout
  (``dropout_rate > 0`` and not ``deterministic``), ``sow_weights=True``
  (``module``), and linen's quantized ``qk_attn_weights_einsum`` /
  ``attn_weights_value_einsum``.

Two differences from flax's own attention remain, both the contract's: a row
with no visible key gives zeros (flax gives the mean of value over all keys),
and its gradients are zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .choose.attention import Attention

__all__ = ["FlaxAttention", "attention_fn"]

_DROPOUT_REFUSED = (
    "attn_backends.flax: attention dropout (dropout_rate={rate}, deterministic=False) is "
    "not supported. Attention dropout zeroes softmax probabilities inside the kernel, and "
    "the kernel here is whichever backend the registry picks per call: the contract has no "
    "dropout hook, and the dropped probabilities cannot be applied outside the kernel "
    "(they depend on query and key together, and are never materialised). Set "
    "dropout_rate=0 on the attention module (dropout elsewhere in the model still works), "
    "call it with deterministic=True (evaluation), or keep flax's own dot_product_attention "
    "for a module that needs attention dropout."
)


class FlaxAttention:
    """flax's ``attention_fn`` signature over a registry ``Attention``; see the module doc.

    Build it with :func:`attention_fn`. ``self.attention`` is the registry
    ``Attention`` every call goes through (``self.attention.explain(...)``
    says which backend serves a call).
    """

    def __init__(self, attention: Attention):
        self.attention = attention

    def __repr__(self) -> str:
        return f"<FlaxAttention over {self.attention!r}>"

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,
        promote_dtype: Callable[..., Sequence[jax.Array]] | None = None,
        is_causal: bool = False,
        force_fp32_for_softmax: bool = False,
        qk_attn_weights_einsum: Any = None,
        attn_weights_value_einsum: Any = None,
    ) -> jax.Array:
        """query ``[batch..., Tq, Hq, D]``, key ``[batch..., Tk, Hkv, D]``, value
        ``[batch..., Tk, Hkv, Dv]`` -> ``[batch..., Tq, Hq, Dv]``.

        ``broadcast_dropout`` and ``dropout_rng`` matter only for the dropout
        this adapter refuses; ``precision`` and ``force_fp32_for_softmax``
        are accepted and left to the backend (module doc).
        """
        _refuse_unsupported(
            dropout_rate, deterministic, module, qk_attn_weights_einsum, attn_weights_value_einsum
        )
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            target = dtype if dtype is not None else jnp.result_type(query, key, value)
            query, key, value = (jnp.asarray(x, target) for x in (query, key, value))
        _refuse_complex(query.dtype)
        batch = _batch_dims(query, key, value)
        tq, hq = query.shape[-3], query.shape[-2]
        tk = key.shape[-3]
        flat = math.prod(batch)
        q, k, v = (x.reshape((flat, *x.shape[-3:])) for x in (query, key, value))
        if mask is not None:
            mask = _pairwise("mask", jnp.asarray(mask).astype(jnp.bool_), batch, hq, tq, tk)
        if bias is not None:
            bias = _pairwise("bias", jnp.asarray(bias), batch, hq, tq, tk)
        causal, window = False, None
        if is_causal:
            if tq < tk:
                # Top-left causal: no query sees a key at or past Tq.
                k, v = k[:, :tq], v[:, :tq]
                mask = None if mask is None else mask[..., :tq]
                bias = None if bias is None else bias[..., :tq]
                causal = True
            elif tq > tk:
                window = (None, tq - tk)
            else:
                causal = True
        out = self.attention(q, k, v, causal=causal, window=window, mask=mask, bias=bias)
        return out.reshape((*batch, tq, hq, out.shape[-1]))


def attention_fn(attention: Attention | None = None, **get_kwargs: Any) -> FlaxAttention:
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` / ``linen.MultiHeadDotProductAttention``.

    Pass a registry ``Attention`` (``attention_fn(registry.get(backend="x"))``)
    or the keyword arguments of ``attn_backends.registry.get``
    (``attention_fn(device="tpu", prefer=["flash_pallas"])``), not both.
    """
    if attention is None:
        from ._wiring import registry

        attention = registry.get(**get_kwargs)
    elif get_kwargs:
        raise TypeError(
            "attention_fn: pass either an Attention or registry.get keyword arguments, "
            f"not both; got an Attention and {sorted(get_kwargs)}"
        )
    if not isinstance(attention, Attention):
        raise TypeError(
            "attention_fn: expected an attn_backends.Attention (from registry.get(...)), "
            f"got {type(attention).__name__}"
        )
    return FlaxAttention(attention)


def _refuse_unsupported(
    dropout_rate: float,
    deterministic: bool,
    module: Any,
    qk_einsum: Any,
    value_einsum: Any,
) -> None:
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(_DROPOUT_REFUSED.format(rate=dropout_rate))
    if module is not None:
        raise NotImplementedError(
            "attn_backends.flax: sow_weights=True asks for the attention weights, which a "
            "registry backend never materialises (flash kernels exist to avoid them). Call "
            "the module without sow_weights, or use flax's own dot_product_attention for the "
            "call that must sow them."
        )
    if qk_einsum is not None or value_einsum is not None:
        raise NotImplementedError(
            "attn_backends.flax: qk_attn_weights_einsum / attn_weights_value_einsum (quantized "
            "einsums) replace the matmuls inside attention, but the backend runs its own kernel. "
            "Leave them unset, or keep flax's own dot_product_attention for this module."
        )


def _refuse_complex(dtype: Any) -> None:
    """flax's attention takes complex inputs; softmax attention over them is not defined."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(
            f"attn_backends.flax: query, key and value are {jnp.dtype(dtype).name}, and no "
            "registry backend computes complex attention: its softmax needs real logits (a "
            "maximum and exp of real numbers), which the contract defines only for float "
            "dtypes. Use real dtypes (float32, bfloat16, float16; float64 under "
            "jax_enable_x64), or keep flax's own dot_product_attention for a complex model."
        )


def _batch_dims(query: jax.Array, key: jax.Array, value: jax.Array) -> tuple[int, ...]:
    """The common leading dims of query, key and value, checked."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(
                f"attn_backends.flax: {name}: expected [batch..., length, heads, head_dim], "
                f"got shape {list(x.shape)}"
            )
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(
            "attn_backends.flax: query, key and value must share their batch dims; got "
            f"query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
        )
    return tuple(batch)


def _pairwise(
    name: str, x: jax.Array, batch: tuple[int, ...], hq: int, tq: int, tk: int
) -> jax.Array:
    """flax's ``[batch..., Hq, Tq, Tk]``-broadcastable x -> the contract's ``[B|1, Hq|1, Tq, Tk]``.

    Batch and head dims of size 1 stay 1 (no copy per batch or head); the
    two length dims are broadcast, since the contract needs them whole.
    """
    full = (*batch, hq, tq, tk)
    if x.ndim > len(full):
        raise ValueError(
            f"attn_backends.flax: {name}: expected at most {len(full)} dims, broadcastable to "
            f"[batch..., heads, q_len, kv_len] = {list(full)}; got shape {list(x.shape)}"
        )
    given = x.shape
    x = x.reshape((1,) * (len(full) - x.ndim) + given)
    nb = len(batch)
    keep_batch = all(d == 1 for d in x.shape[:nb])
    target_batch = (1,) * nb if keep_batch else batch
    heads = 1 if x.shape[nb] == 1 else hq
    try:
        x = jnp.broadcast_to(x, (*target_batch, heads, tq, tk))
    except ValueError:
        raise ValueError(
            f"attn_backends.flax: {name}: shape {list(given)} does not broadcast to "
            f"[batch..., heads, q_len, kv_len] = {list(full)}"
        ) from None
    return x.reshape((math.prod(target_batch), heads, tq, tk))
