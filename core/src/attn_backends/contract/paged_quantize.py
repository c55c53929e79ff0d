"""The quantizer of a quantized paged cache (docs/DESIGN.md, "Quantized caches"),
in JAX: what ``write`` stores for each token, and what a backend reads back.

One float32 scale per (position, kv head) for K and for V: ``x ~= value * scale``
over the ``head_dim`` elements of that position and head. Loaded by the first
quantized ``write``, not by ``import attn_backends``.

- int8: ``scale = max|x| / 127`` (as ``max|x| * float32(1/127)``: the same bytes
  in every program), ``value = round_half_even(x / scale)`` in
  [-127, 127] (symmetric: -128 is never written);
- float8_e4m3fn / float8_e5m2: ``scale = max|x| / F`` (F the format's largest
  finite value, 448 and 57344), ``value = x / scale`` rounded to the format.

Every element is then within half a step of its value's scale. A position and
head of zeros stores scale 0 and values 0. One holding NaN or +-Inf stores
scale NaN and values 0: it dequantizes to NaN there, at that position and head
only (where an unquantized cache holds the non-finite value), never in another
position's or sequence's pages.
"""

from __future__ import annotations

from typing import Any

#: The largest value each quantized dtype stores.
LARGEST = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize(x: Any, kv_dtype: str) -> tuple[Any, Any]:
    """x ``[..., D]`` (any float dtype) -> (values ``[..., D]`` in ``kv_dtype``,
    scales float32 ``[...]``), by the rule above."""
    import jax.numpy as jnp

    largest = LARGEST[kv_dtype]
    x = x.astype(jnp.float32)
    # Finiteness tested element by element, not read off the max: inside a
    # fused write program XLA's cpu max over a row of 128 dropped a NaN (the
    # suite's quantized store case on flash_pallas found it).
    finite = jnp.all(jnp.isfinite(x), axis=-1)
    peak = jnp.max(jnp.abs(jnp.where(jnp.isfinite(x), x, 0.0)), axis=-1)
    # A product by the constant 1/largest, never a division by it: XLA turns a
    # division by a constant into that product in jitted programs and not in
    # eager ones (jax 0.12.1), so a division gave the same cache other bytes
    # (a scale 1 ulp apart) when written by another program; a product is one
    # IEEE operation everywhere. It is max|x| / largest to float32 rounding.
    scale = jnp.where(finite, peak * jnp.float32(1.0 / largest), jnp.nan)
    # Zero and non-finite rows divide by 1 (their values are zeroed below), so no
    # 0/0 or Inf/Inf is ever computed.
    usable = finite & (peak > 0)
    ratio = x / jnp.where(usable, scale, 1.0)[..., None]
    ratio = jnp.clip(ratio, -largest, largest)
    if kv_dtype == "int8":
        ratio = jnp.round(ratio)
    values = jnp.where(usable[..., None], ratio, 0.0).astype(kv_dtype)
    return values, scale.astype(jnp.float32)


def dequantize(values: Any, scales: Any, dtype: Any) -> Any:
    """values ``[..., D]`` and scales ``[...]`` -> ``values * scales`` ``[..., D]`` in
    ``dtype`` (the product taken in float32 or, for float64, in float64)."""
    import jax.numpy as jnp

    wide = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    return (values.astype(wide) * scales.astype(wide)[..., None]).astype(dtype)
