"""A registry ``Attention`` as the ``attention_fn`` of flax's attention modules.

::

    from flax import nnx
    from attn_backends_flax import attention_fn

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
  ``[B|1, Hq|1, Tq, Tk]``; a mask whose head and query axes are 1 (flax's
  decode cache mask, a padding mask ``[B, 1, 1, Tk]``) stays a key mask
  ``[B|1, 1, 1, Tk]``, which core can hand a kernel as segment ids.
  ``bias``: broadcast to ``[B|1, Hq|1, Tq, Tk]``.
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
- ``precision`` is not forwarded to backends: each fixes its own matmul
  precision (softmax is float32 in every backend), as flax's own
  ``jax.nn.dot_product_attention`` path ignores it too; the dense path
  uses it, as flax's own einsums do.
  ``force_fp32_for_softmax`` (linen) is always true here.
- ``module`` (flax passes it for ``sow_weights=True``): the weights are
  asked for, and no registry backend materialises them. That call is served
  on purpose by the adapter's own dense path (``attn_backends_flax._dense``):
  the contract's rules exactly (the causal mapping above, mask, bias, GQA,
  float32 softmax; a row with no visible key has zero weights), whose output
  is that same ``weights @ value``, so the two agree. The weights
  ``[batch..., Hq, Tq, Tk]`` are sown where flax's own attention sows them:
  linen's ``"intermediates"`` collection, nnx's ``nnx.Intermediate``, under
  ``"attention_weights"``, in the computation dtype (float32 with linen's
  ``force_fp32_for_softmax``). One ``FallbackWarning`` per call signature says
  so, following the attention's ``fallback`` (``"silent"``: none; ``"error"``:
  ``UnsupportedError`` instead).
- Attention dropout (``dropout_rate > 0`` and not ``deterministic``) is the
  contract's: ``dropout_rate`` and flax's ``dropout_rng`` (typed or raw key)
  go to the backend, which drops each weight of the softmax with that
  probability and scales the rest by ``1 / (1 - rate)``, as flax does; a
  backend that does not claim dropout is never selected for such a call.
  The same rng gives the same result, ``deterministic=True`` none; with
  ``sow_weights`` as well it is refused (the dense path draws no keep-mask). One
  difference: the keep-mask is drawn independently for every batch row and
  head (as PyTorch SDPA and FlashAttention do), whatever
  ``broadcast_dropout`` says; flax's default (``broadcast_dropout=True``)
  shares one ``[Tq, Tk]`` mask across them. The same in expectation; not the
  same draw as flax's for a given rng.
- ``input_positions`` (flax >= 0.12.12's ``nnx.MultiHeadAttention(x,
  input_positions=...)``): with ``attention_fn(..., rope=nnx.RoPE(...))``,
  query and key are rotated at those positions before the registry's
  attention, as ``nnx.dot_product_attention_with_rope`` does
  (``attn_backends_flax._inputs``); without ``rope``, refused.
- Refused, with an error saying why and what to do: linen's quantized
  ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum``.

Which backend served each call: ``fn.served`` maps every call signature the
adapter has served (:class:`FlaxSignature`) to the backend's name, and
``fn.explain()`` gives, per signature, the contract call it became (batch dims
flattened, the causal mapping) and the registry's explanation.

Two differences from flax's own attention remain, both the contract's: a row
with no visible key gives zeros (flax gives the mean of value over all keys),
and its gradients are zeros.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from attn_backends.choose.attention import SELECTION_CACHE_SIZE, Attention
from attn_backends.choose.select import Explanation
from attn_backends.contract.arguments import bind
from attn_backends.contract.call import AttentionCall

from ._dense import DENSE_PATH, SOWN_DROPOUT_REFUSED, announce_dense, dense, sow
from ._inputs import NO_ROPE, refuse_complex, refuse_unsupported, with_rope

__all__ = [
    "DENSE_PATH", "FlaxAttention", "FlaxExplanation", "FlaxSignature", "ServedCall", "attention_fn",
]


@dataclass(frozen=True)
class FlaxSignature:
    """One call signature as flax made it: shapes before flattening, the dtype
    computed in (after promotion), mask and bias shapes, and the flags."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: str
    mask: tuple[int, ...] | None = None
    bias: tuple[int, ...] | None = None
    is_causal: bool = False
    sow_weights: bool = False

    def __str__(self) -> str:
        def dims(shape: tuple[int, ...]) -> str:
            return "[" + ",".join(map(str, shape)) + "]"

        parts = [f"query{dims(self.query)} key{dims(self.key)} value{dims(self.value)}",
                 self.dtype]
        parts += [f"{name}{dims(shape)}" for name, shape in (("mask", self.mask),
                                                             ("bias", self.bias)) if shape]
        parts += [flag for flag in ("is_causal", "sow_weights") if getattr(self, flag)]
        return " ".join(parts)


@dataclass(frozen=True)
class ServedCall:
    """What one flax call signature became and who served it.

    ``call`` is the contract call (batch dims flattened into B, ``is_causal``
    mapped as ``mapping`` says); ``backend`` the serving backend's name
    (``"tpu=a, cpu=b"`` when platforms differ; :data:`DENSE_PATH` for
    ``sow_weights``); ``explanations`` the registry's, one per platform
    (none for the dense path, which asks no backend).
    """

    signature: FlaxSignature
    call: AttentionCall
    mapping: str
    backend: str
    explanations: tuple[Explanation, ...] = ()

    def __str__(self) -> str:
        lines = [f"flax call: {self.signature}",
                 f"contract call: {self.call.describe()} ({self.mapping})",
                 f"served by: {self.backend}"]
        if not self.explanations:
            lines.append("  the weights were asked for (sow_weights=True), which no registry "
                         "backend materialises: the adapter computed them densely, with the "
                         "output as their product with value")
        for explanation in self.explanations:
            lines += ["  " + line for line in str(explanation).splitlines()]
        return "\n".join(lines)


@dataclass(frozen=True)
class FlaxExplanation:
    """``FlaxAttention.explain()``: every call signature served so far, oldest first."""

    calls: tuple[ServedCall, ...]

    def __str__(self) -> str:
        if not self.calls:
            return ("attn_backends_flax: no call served yet (trace or run the module first: "
                    "signatures are recorded when a call is traced)")
        return "\n\n".join(map(str, self.calls))


class FlaxAttention:
    """flax's ``attention_fn`` signature over a registry ``Attention``; see the module doc.

    Build it with :func:`attention_fn`. ``self.attention`` is the registry
    ``Attention`` every call goes through; ``served`` and ``explain()`` say
    which backend served each call signature (recorded when it is traced).
    """

    def __init__(self, attention: Attention, rope: Any = None):
        self.attention = attention
        self.rope = rope
        self._calls: OrderedDict[FlaxSignature, ServedCall] = OrderedDict()
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<FlaxAttention over {self.attention!r}>"

    @property
    def served(self) -> dict[FlaxSignature, str]:
        """Each call signature served so far -> the name of the backend that served it."""
        with self._lock:
            return {signature: served.backend for signature, served in self._calls.items()}

    def explain(self) -> FlaxExplanation:
        """Per call signature served so far: the contract call it became, the causal
        mapping, the backend, and the registry's explanation (printable)."""
        with self._lock:
            return FlaxExplanation(tuple(self._calls.values()))

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
        input_positions: jax.Array | None = None,
    ) -> jax.Array:
        """query ``[batch..., Tq, Hq, D]``, key ``[batch..., Tk, Hkv, D]``, value
        ``[batch..., Tk, Hkv, Dv]`` -> ``[batch..., Tq, Hq, Dv]``.

        ``dropout_rate`` with ``dropout_rng`` is the contract's dropout unless
        ``deterministic`` (each batch row and head draws its own mask, whatever
        ``broadcast_dropout`` says); ``precision`` is accepted and left to the
        backend, ``force_fp32_for_softmax`` is always true here (module doc).
        ``module`` sows the weights ``[batch..., Hq, Tq, Tk]`` (module doc);
        ``input_positions`` (``[T]`` or ``[batch..., T]``) need ``rope`` (module doc).
        """
        refuse_unsupported(qk_attn_weights_einsum, attn_weights_value_einsum)
        if self.rope is not None:
            query, key = with_rope(self.rope, query, key, input_positions)
        elif input_positions is not None:
            raise TypeError(NO_ROPE)
        dropout: dict[str, Any] = {}
        if dropout_rate > 0.0 and not deterministic:
            if module is not None:
                raise NotImplementedError(SOWN_DROPOUT_REFUSED.format(rate=dropout_rate))
            dropout = {"dropout_rate": float(dropout_rate), "dropout_key": dropout_rng}
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            target = dtype if dtype is not None else jnp.result_type(query, key, value)
            query, key, value = (jnp.asarray(x, target) for x in (query, key, value))
        refuse_complex(query.dtype)
        batch = _batch_dims(query, key, value)
        tq, hq = query.shape[-3], query.shape[-2]
        tk = key.shape[-3]
        signature = FlaxSignature(
            tuple(query.shape), tuple(key.shape), tuple(value.shape),
            jnp.dtype(query.dtype).name,
            None if mask is None else tuple(jnp.shape(mask)),
            None if bias is None else tuple(jnp.shape(bias)),
            bool(is_causal), module is not None,
        )
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
        kwargs = {"causal": causal, "window": window, "mask": mask, "bias": bias,
                  **dropout}
        if module is None:
            out = self.attention(q, k, v, **kwargs)
            self._record(signature, q, k, v, kwargs, batch)
        else:
            call, _ = bind(q, k, v, **kwargs)
            self._record(signature, q, k, v, kwargs, batch, call)
            out, weights = dense(call, q, k, v, mask, bias, precision)
            # Keys a top-left causal call cut are visible to no query: weight 0.
            weights = jnp.pad(weights, ((0, 0), (0, 0), (0, 0), (0, tk - weights.shape[-1])))
            sown = jnp.float32 if force_fp32_for_softmax else query.dtype
            sow(module, weights.astype(sown).reshape((*batch, hq, tq, tk)))
            out = out.astype(query.dtype)
        return out.reshape((*batch, tq, hq, out.shape[-1]))

    def _record(self, signature: FlaxSignature, q: jax.Array, k: jax.Array, v: jax.Array,
                kwargs: dict[str, Any], batch: tuple[int, ...],
                dense_call: AttentionCall | None = None) -> None:
        """Remember what ``signature`` became, on its first sight (at trace time);
        the dense path says so then, once, as the attention's ``fallback`` asks."""
        # Held throughout, so threads tracing one signature at once warn once.
        with self._lock:
            if signature in self._calls:
                self._calls.move_to_end(signature)
                return
            mapping = _mapping(signature, batch)
            if dense_call is not None:
                announce_dense(self.attention.fallback, signature)
                served = ServedCall(signature, dense_call, mapping, DENSE_PATH)
            else:
                served = self._explained(signature, mapping, q, k, v, kwargs)
            self._calls[signature] = served
            while len(self._calls) > SELECTION_CACHE_SIZE:
                self._calls.popitem(last=False)

    def _explained(self, signature: FlaxSignature, mapping: str, q: jax.Array, k: jax.Array,
                   v: jax.Array, kwargs: dict[str, Any]) -> ServedCall:
        """The registry's explanation of the contract call, one per platform served."""
        attention = self.attention
        explanations = [attention.explain(q, k, v, **kwargs)]
        call = explanations[0].call
        explanations += [attention.explain_call(call, platform=p)
                         for p, _ in attention.platforms[1:]]
        chosen = {e.platform: e.chosen or "?" for e in explanations}
        backend = (next(iter(chosen.values())) if len(set(chosen.values())) == 1
                   else ", ".join(f"{p}={name}" for p, name in chosen.items()))
        return ServedCall(signature, call, mapping, backend, tuple(explanations))


def attention_fn(attention: Attention | None = None, *, rope: Any = None,
                 **get_kwargs: Any) -> FlaxAttention:
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` / ``linen.MultiHeadDotProductAttention``.

    Pass a registry ``Attention`` (``attention_fn(registry.get(backend="x"))``)
    or the keyword arguments of ``attn_backends.registry.get``
    (``attention_fn(device="tpu", prefer=["flash_pallas"])``), not both.
    ``rope`` (an ``nnx.RoPE``): rotate query and key first, as
    ``nnx.dot_product_attention_with_rope`` does, at flax's ``input_positions``.
    """
    if attention is None:
        from attn_backends.choose.registry import registry

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
    if attention.layout != "BTNH":
        raise ValueError(
            f"attention_fn: flax hands over [batch..., T, H, D] arrays, but this attention "
            f"takes layout={attention.layout!r}: get it with the default layout='BTNH'"
        )
    return FlaxAttention(attention, rope)


def _batch_dims(query: jax.Array, key: jax.Array, value: jax.Array) -> tuple[int, ...]:
    """The common leading dims of query, key and value, checked."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(
                f"attn_backends_flax: {name}: expected [batch..., length, heads, head_dim], "
                f"got shape {list(x.shape)}"
            )
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(
            "attn_backends_flax: query, key and value must share their batch dims; got "
            f"query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
        )
    return tuple(batch)


def _pairwise(
    name: str, x: jax.Array, batch: tuple[int, ...], hq: int, tq: int, tk: int
) -> jax.Array:
    """flax's ``[batch..., Hq, Tq, Tk]``-broadcastable x -> the contract's ``[B|1, Hq|1, Tq, Tk]``.

    Batch and head dims of size 1 stay 1 (no copy per batch or head); the
    two length dims are broadcast, since the contract needs them whole,
    except a mask's Tq when its heads and Tq are 1: a key mask ``[B|1, 1, 1, Tk]``.
    """
    full = (*batch, hq, tq, tk)
    if x.ndim > len(full):
        raise ValueError(
            f"attn_backends_flax: {name}: expected at most {len(full)} dims, broadcastable to "
            f"[batch..., heads, q_len, kv_len] = {list(full)}; got shape {list(x.shape)}"
        )
    given = x.shape
    x = x.reshape((1,) * (len(full) - x.ndim) + given)
    nb = len(batch)
    keep_batch = all(d == 1 for d in x.shape[:nb])
    target_batch = (1,) * nb if keep_batch else batch
    heads = 1 if x.shape[nb] == 1 else hq
    # A mask equal for every head and query row stays a key mask [B|1, 1, 1, Tk].
    rows = 1 if name == "mask" and x.shape[nb:nb + 2] == (1, 1) else tq
    try:
        x = jnp.broadcast_to(x, (*target_batch, heads, rows, tk))
    except ValueError:
        raise ValueError(
            f"attn_backends_flax: {name}: shape {list(given)} does not broadcast to "
            f"[batch..., heads, q_len, kv_len] = {list(full)}"
        ) from None
    return x.reshape((math.prod(target_batch), heads, rows, tk))


def _mapping(signature: FlaxSignature, batch: tuple[int, ...]) -> str:
    """How a flax call became its contract call, for people."""
    tq, tk = signature.query[-3], signature.key[-3]
    parts = [f"batch dims {list(batch)} flattened into B={math.prod(batch)}"]
    if not signature.is_causal:
        parts.append("no is_causal")
    elif tq == tk:
        parts.append("is_causal (top-left) with Tq == Tk: causal=True")
    elif tq < tk:
        parts.append(f"is_causal (top-left) with Tq < Tk: keys cut to the first {tq}, "
                     "causal=True")
    else:
        parts.append(f"is_causal (top-left) with Tq > Tk: window=(None, {tq - tk})")
    if signature.sow_weights:
        parts.append("sow_weights: the adapter's dense path")
    return "; ".join(parts)
