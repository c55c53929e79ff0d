"""One contract call through ``tokamax.dot_product_attention``.

BTNH in and out on both sides, and the same GQA head mapping (query head h
reads kv head ``h // group``), so q, k and v pass unchanged. What the adapter
adds: the visibility mapping (``_masks``), zeros for rows that see no key
(tokamax gives them the mean of V), float16 computed in float32 when lowering
for cpu (tokamax asks ``dot_general`` for the ``F16_F16_F32`` algorithm, which
XLA:CPU rejects), and the implementation, passed explicitly
(``implementation=``), never tokamax's choice by default device. A quantized K
and V (``call.kv_dtype``) go to tokamax as qwix ``QArray``s: the values and
their per-position scales broadcast over the head dim (tokamax's own int8
tests quantize with ``channelwise_axes=(0, 1, 2)``, this layout).
"""

from __future__ import annotations

from typing import Any

from attn_backends import AttentionCall, Operands

from ._environment import import_tokamax
from ._masks import padded, visibility


class RegistryDecidesPlatform:
    """Mixin for a tokamax implementation class (first in the bases): its
    ``supported_on`` is the registry's decision.

    tokamax's own asks the *default device* (or the inputs' devices) whether it
    has the hardware: from a cpu host that refuses every TPU or cuda export and
    every interpreted run. The backend's manifest and ``check`` have already
    decided, from the platform being lowered for, before tokamax runs.
    """

    def supported_on(self, device: Any) -> bool:
        return True


def run(call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
        implementation: Any, *, native: bool = True, multiple: int = 1) -> Any:
    """q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` -> out
    ``[B, Tq, Hq, Dv]`` in q's dtype.

    ``implementation``: a name tokamax knows (``"xla"``, ``"xla_chunked"``) or
    one of its implementation objects; ``native``: whether lengths, window and
    causal go to tokamax's own arguments (see :func:`_masks.visibility`);
    ``multiple``: Tq and Tk are padded to a multiple of it (Mosaic TPU's blocks
    must divide them), the padded keys hidden by the mask (or, for a causal call
    with Tq == Tk, by causality) and the padded rows cut off.
    """
    import jax.numpy as jnp

    tokamax = import_tokamax()
    seen = visibility(call, operands, native=native)
    dtype = q.dtype
    mask = seen.mask
    tq, tk = (-(-n // multiple) * multiple for n in (call.q_len, call.kv_len))
    if (tq, tk) != (call.q_len, call.kv_len):
        if mask is not None or not seen.is_causal:
            mask = padded(mask, call, tq, tk)
        q = jnp.pad(q, ((0, 0), (0, tq - call.q_len), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, tk - call.kv_len), (0, 0), (0, 0))) for x in (k, v))
    if call.platform == "cpu" and call.dtype == "float16":
        q = q.astype(jnp.float32)
        if call.kv_dtype is None:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if call.kv_dtype is not None:
        k, v = _quantized(k, v, operands, tk - call.kv_len)
    out = tokamax.dot_product_attention(
        q, k, v,
        bias=operands.bias,
        mask=mask,
        scale=call.scale,
        is_causal=seen.is_causal,
        query_seq_lengths=seen.q_lengths,
        key_value_seq_lengths=seen.kv_lengths,
        local_window_size=seen.window,
        logits_soft_cap=call.softcap,
        implementation=(implementation,),
    )
    out = out[:, :call.q_len].astype(dtype)
    if seen.rows is not None:
        # [B|1, Hq|1, Tq, 1] -> [B|1, Tq, Hq|1, 1]; `where` also gives those rows
        # zero gradients, as the contract says.
        out = jnp.where(seen.rows.transpose(0, 2, 1, 3), out, jnp.zeros((), out.dtype))
    return out


def _quantized(k: Any, v: Any, operands: Operands, pad: int) -> tuple[Any, Any]:
    """k and v (values ``[B, Tk + pad, Hkv, D]``) as qwix ``QArray``s with their
    scales ``[B, Tk, Hkv]`` (padded with 0) as ``[B, Tk + pad, Hkv, 1]``."""
    import jax.numpy as jnp
    import qwix

    def one(x: Any, scales: Any) -> Any:
        scales = jnp.pad(scales, ((0, 0), (0, pad), (0, 0)))[..., None]
        return qwix.QArray(qvalue=x, scale=scales, qtype=x.dtype)

    return one(k, operands.k_scales), one(v, operands.v_scales)
