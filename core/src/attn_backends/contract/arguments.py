"""``bind``: the arguments of ``attention(q, k, v, ...)`` checked once and made into
an :class:`AttentionCall` and its :class:`Operands`. Its checks, shared with
``bind_paged``, each raise ``ValueError`` naming the argument, what was expected
and what arrived (and, where a shape looks transposed, the fix). Loaded by the
first call, not at ``import attn_backends`` (``attn_backends.bind`` loads it).
"""

from __future__ import annotations

import math
from typing import Any, Unpack

import numpy as np

from .call import (
    QUANTIZED_KV_DTYPES,
    WIDE_DTYPES,
    AttentionCall,
    AttentionKeywords,
    Operands,
    bindable,
    keywords,
)

_BHTD_HINT = (
    "for [B, H, T, D] arrays get the attention with registry.get(layout='BHTD') "
    "(or transpose them with x.transpose(0, 2, 1, 3))."
)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name


def check_float(name: str, dt: str) -> None:
    """Raise unless ``dt`` is a dtype the contract computes attention in."""
    if bindable(dt):
        return
    if dt in WIDE_DTYPES:
        raise ValueError(
            f"{name}: dtype {dt} needs jax_enable_x64 (without it JAX computes in float32); "
            "enable it (jax.config.update('jax_enable_x64', True)) or cast to float32"
        )
    why = ""
    if np.issubdtype(np.dtype(dt), np.complexfloating):
        why = (" Attention's softmax is defined for real logits only (a maximum and exp of "
               "real numbers); a complex model needs its own attention.")
    raise ValueError(
        f"{name}: expected dtype float32, bfloat16 or float16 (float64 under "
        f"jax_enable_x64), got {dt}.{why}"
    )


def require_array(name: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
            f"{name}: expected an array (jax.Array, numpy array or ShapeDtypeStruct), "
            f"got {type(x).__name__}. Wrap it with jnp.asarray(...)."
        )


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_array(name, x)
        if len(x.shape) != 4:
            raise ValueError(
                f"{name}: expected rank 4 [B, T, H, D] (BTNH layout, as "
                f"jax.nn.dot_product_attention), got shape {shape_of(x)}"
            )
    dtypes = {n: dtype_name(x) for n, x in (("q", q), ("k", k), ("v", v))}
    check_float("q", dtypes["q"])
    if {dtypes["k"], dtypes["v"]} & set(QUANTIZED_KV_DTYPES):  # quantized: check_scales
        if dtypes["k"] != dtypes["v"]:
            raise ValueError(
                f"k, v: expected both quantized in one dtype (with k_scales and v_scales), "
                f"got k={dtypes['k']}, v={dtypes['v']}; quantize both alike "
                "(attn_backends.authoring.quantize)")
    else:
        for name in ("k", "v"):
            try:
                check_float(name, dtypes[name])
            except ValueError as error:
                raise ValueError(f"{str(error).rstrip('.')}; or, stored quantized, one of "
                                 f"{list(QUANTIZED_KV_DTYPES)} with k_scales and "
                                 "v_scales") from None
    if dtypes["k"] not in QUANTIZED_KV_DTYPES and len(set(dtypes.values())) > 1:
        raise ValueError(
            f"q, k, v: expected one dtype, got q={dtypes['q']}, k={dtypes['k']}, "
            f"v={dtypes['v']}. Cast them to the same dtype."
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if any(n < 0 for n in shape_of(x)):
            raise ValueError(f"{name}: expected sizes >= 0, got shape {list(shape_of(x))}")
    (bq, tq, hq, d), (bk, tk, hk, dk), (bv, tv, hv, _) = map(shape_of, (q, k, v))
    layout_hint = " The layout is BTNH [B, T, H, D]; " + _BHTD_HINT
    if not bq == bk == bv:
        raise ValueError(f"batch: expected q, k, v to share B, got {bq}, {bk}, {bv}")
    if tk != tv:
        raise ValueError(f"k, v: expected the same length Tk, got {tk} and {tv}.{layout_hint}")
    if hk != hv:
        raise ValueError(f"k, v: expected the same kv heads, got {hk} and {hv}.{layout_hint}")
    if dk != d:
        raise ValueError(
            f"k: expected head dim D={d} (from q), got {dk}; q and k must share D.{layout_hint}"
        )
    if d == 0 or hq == 0:
        raise ValueError(
            f"q: expected at least one head and a head dim >= 1, got Hq={hq}, D={d} "
            f"(shape {[bq, tq, hq, d]})"
        )
    if hk == 0 or hq % hk:
        raise ValueError(
            f"heads: expected q heads Hq={hq} to be a multiple of kv heads Hkv={hk} "
            f"(GQA/MQA).{layout_hint}"
        )


def check_scales(k: Any, k_scales: Any, v_scales: Any, b: int, tk: int, hkv: int) -> str | None:
    """The quantized dtype of K and V (its scales checked), or None when K and V
    are not quantized (then no scales may be given)."""
    kv_dtype = dtype_name(k)
    scales = (("k_scales", k_scales), ("v_scales", v_scales))
    if kv_dtype not in QUANTIZED_KV_DTYPES:
        for name, x in scales:
            if x is not None:
                raise ValueError(
                    f"{name}: given with k and v in {kv_dtype}, which are not quantized; "
                    f"scales go with K and V stored in one of {list(QUANTIZED_KV_DTYPES)} "
                    "(attention reads value * scale): leave it out")
        return None
    want = [b, tk, hkv]
    for name, x in scales:
        if x is None:
            raise ValueError(
                f"{name}: k and v are quantized ({kv_dtype}), so their float32 scales "
                f"{want} [B, Tk, Hkv] are needed (attention reads value * scale), got None")
        require_array(name, x)
        if list(shape_of(x)) != want:
            hint = ""
            if list(shape_of(x)) == [b, hkv, tk]:
                hint = ("; it looks like [B, Hkv, Tk]: scales are [B, Tk, Hkv] in both "
                        "layouts, so pass x.transpose(0, 2, 1)")
            raise ValueError(f"{name}: expected shape [B, Tk, Hkv] = {want} (one scale per "
                             f"position and kv head), got {list(shape_of(x))}{hint}")
        if dtype_name(x) != "float32":
            raise ValueError(f"{name}: expected dtype float32, got {dtype_name(x)}; pass "
                             "x.astype(jnp.float32)")
    return kv_dtype


def check_int_array(
    name: str, x: Any, shape: tuple[int, ...], heads: tuple[int, ...] = ()
) -> None:
    require_array(name, x)
    if shape_of(x) != shape:
        hint = bhtd_suspect(shape_of(x)[1:], heads) if heads else ""
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(shape_of(x))}{hint}")
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise ValueError(f"{name}: expected an integer dtype, got {dtype_name(x)}")


def check_pairwise(
    name: str, x: Any, b: int, hq: int, hkv: int, tq: int, tk: int, *, key_mask: bool = False
) -> tuple[int, int, int, int]:
    """The shape of a ``[B|1, Hq|1, Tq, Tk]`` array (``key_mask``: or ``[B|1, 1, 1, Tk]``)."""
    require_array(name, x)
    shape = shape_of(x)
    ok = (
        len(shape) == 4
        and shape[0] in (1, b)
        and shape[1] in (1, hq)
        and (shape[2:] == (tq, tk) or (key_mask and shape[1:] == (1, 1, tk)))
    )
    if not ok:
        also = f" or a key mask [{b}|1, 1, 1, {tk}]" if key_mask else ""
        raise ValueError(
            f"{name}: expected shape [B|1, Hq|1, Tq, Tk] = [{b}|1, {hq}|1, {tq}, {tk}]"
            f"{also}, got {list(shape)}" + bhtd_suspect(shape[-2:], (hq, hkv))
        )
    return shape  # type: ignore[return-value]


def bhtd_suspect(lengths: tuple[int, ...], heads: tuple[int, ...]) -> str:
    """A hint when a wrongly shaped argument's lengths are q and k's head counts
    as BTNH reads them: q, k, v are then most likely [B, H, T, D] arrays."""
    if lengths != heads:
        return ""
    return (
        f". Its lengths {list(lengths)} are what BTNH reads as head counts: q, k, v "
        "look like [B, H, T, D] arrays; " + _BHTD_HINT
    )


def check_scale(scale: Any, d: int) -> float:
    if scale is None:
        return d**-0.5 if d else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise ValueError(
            f"scale: expected a static Python float (it is part of the compiled "
            f"program), got {type(scale).__name__}. Pass float(scale)."
        )
    # Logits are float32 at best: a scale float32 cannot hold is inf there.
    if not math.isfinite(float(scale)) or abs(float(scale)) > _FLOAT32_MAX:
        raise ValueError(f"scale: expected a finite number within float32's range, got {scale}")
    return float(scale)


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window: expected (left, right), each an int >= 0 or None, got {window!r}"
        )
    sides = []
    for side_name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise ValueError(f"window: {side_name} side must be an int or None, got {side!r}")
        if side < 0:
            raise ValueError(
                f"window: {side_name} side must be >= 0 (keys visible on that side "
                f"of the diagonal), got {int(side)}"
            )
        sides.append(int(side))
    if sides == [None, None]:
        return None
    return (sides[0], sides[1])


def check_softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise ValueError(f"softcap: expected a static float > 0 or None, got {softcap!r}")
    if not (math.isfinite(float(softcap)) and softcap > 0):
        raise ValueError(f"softcap: expected a finite value > 0, got {softcap}")
    return float(softcap)


def is_typed_key(x: Any) -> bool:
    import jax

    return bool(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def check_dropout(rate: Any, key: Any) -> float:
    """The static rate in [0, 1); a rate > 0 needs a key, a key needs a rate > 0."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise ValueError(
            f"dropout_rate: expected a static Python float in [0, 1) (it is part of the "
            f"compiled program), got {type(rate).__name__}. Pass float(rate)."
        )
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate: expected a value in [0, 1), got {rate}")
    if rate > 0 and key is None:
        raise ValueError(
            f"dropout_key: dropout_rate={rate} needs a PRNG key (jax.random.key(seed) or "
            "jax.random.PRNGKey(seed)), got None"
        )
    if rate == 0 and key is not None:
        raise ValueError(
            "dropout_key: given with dropout_rate=0, which drops nothing; pass "
            "dropout_rate > 0, or leave the key out"
        )
    if key is None:
        return rate
    require_array("dropout_key", key)
    typed = is_typed_key(key)
    raw = not typed and dtype_name(key) == "uint32" and shape_of(key) == (2,)
    if not raw and not (typed and shape_of(key) == ()):
        raise ValueError(
            "dropout_key: expected one PRNG key, a typed key array of shape [] "
            "(jax.random.key(seed)) or a raw uint32[2] key (jax.random.PRNGKey(seed)), "
            f"got {key.dtype} of shape {list(shape_of(key))}"
        )
    return rate


def bind(q: Any, k: Any, v: Any, **kwargs: Unpack[AttentionKeywords]
         ) -> tuple[AttentionCall, Operands]:
    """Validate the arguments of ``attention(...)`` and normalise them.

    Returns ``(call, operands)``. Raises ``ValueError`` for any bad argument:
    naming it, what was expected and what arrived, before any backend runs
    (a TypeError for a keyword the contract does not have).
    """
    kw = keywords(kwargs, AttentionKeywords, "attention()")
    causal, return_lse, segment_ids, mask, bias = (
        kw["causal"], kw["return_lse"], kw["segment_ids"], kw["mask"], kw["bias"])
    q_lengths, kv_lengths, k_scales, v_scales = (
        kw["q_lengths"], kw["kv_lengths"], kw["k_scales"], kw["v_scales"])
    check_qkv(q, k, v)
    b, tq, hq, d = shape_of(q)
    tk, hkv, dv = shape_of(v)[1:]
    kv_dtype = check_scales(k, k_scales, v_scales, b, tk, hkv)
    for flag_name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(
                f"{flag_name}: expected a Python bool (it selects the compiled program), "
                f"got {type(flag).__name__}. Under jit, mark it static "
                "(static_argnames) or close over it."
            )
    q_ids = kv_ids = None
    if segment_ids is not None:
        if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
            raise ValueError(
                "segment_ids: expected a pair (q_ids [B, Tq], kv_ids [B, Tk]), "
                f"got {type(segment_ids).__name__}"
            )
        q_ids, kv_ids = segment_ids
        check_int_array("segment_ids[0] (q_ids)", q_ids, (b, tq), (hq,))
        check_int_array("segment_ids[1] (kv_ids)", kv_ids, (b, tk), (hkv,))
    if q_lengths is not None:
        check_int_array("q_lengths", q_lengths, (b,))
    if kv_lengths is not None:
        check_int_array("kv_lengths", kv_lengths, (b,))
    mask_shape = bias_shape = bias_dtype = None
    if mask is not None:
        mask_shape = check_pairwise("mask", mask, b, hq, hkv, tq, tk, key_mask=True)
        if dtype_name(mask) != "bool":
            raise ValueError(
                f"mask: expected dtype bool (True = visible), got {dtype_name(mask)}; "
                "for additive masks use bias="
            )
    if bias is not None:
        bias_shape = check_pairwise("bias", bias, b, hq, hkv, tq, tk)
        bias_dtype = dtype_name(bias)
        check_float("bias", bias_dtype)
    call = AttentionCall(
        batch=b,
        q_len=tq,
        kv_len=tk,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        dtype=dtype_name(q),
        scale=check_scale(kw["scale"], d),
        causal=bool(causal),
        window=check_window(kw["window"]),
        segment_ids=segment_ids is not None,
        q_lengths=q_lengths is not None,
        kv_lengths=kv_lengths is not None,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        bias_dtype=bias_dtype,
        softcap=check_softcap(kw["softcap"]),
        return_lse=bool(return_lse),
        dropout_rate=check_dropout(kw["dropout_rate"], kw["dropout_key"]),
        kv_dtype=kv_dtype,
    )
    return call, Operands(q_ids, kv_ids, q_lengths, kv_lengths, mask, bias, kw["dropout_key"],
                          k_scales, v_scales)
