"""The attention contract (api_version 1): validate user arguments once.

`bind` turns the arguments of ``attention(q, k, v, ...)`` into a frozen,
hashable :class:`AttentionCall` (static shapes, dtypes and flags, what the
selector and every backend read) plus :class:`Operands` (the optional arrays).
Every bad argument raises ``ValueError`` naming it, what was expected and what
arrived, before any backend runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

API_VERSION = 1
SUPPORTED_API_VERSIONS = frozenset({1})

#: Call features a manifest may claim; a call uses a subset of them.
FEATURES = (
    "gqa",
    "causal",
    "window",
    "segment_ids",
    "lengths",
    "mask",
    "bias",
    "softcap",
    "return_lse",
    "dropout",
)
#: The dtypes every backend claims unless its manifest says otherwise.
DTYPES = frozenset({"float32", "bfloat16", "float16"})
#: Dtypes a call may have only under ``jax_enable_x64`` (without it JAX would
#: compute them in float32); a backend serves them only if its manifest claims them.
WIDE_DTYPES = frozenset({"float64"})
_BHTD_HINT = (
    "for [B, H, T, D] arrays get the attention with registry.get(layout='BHTD') "
    "(or transpose them with x.transpose(0, 2, 1, 3))."
)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class AttentionCall:
    """Static description of one attention call; hashable, so it keys caches.

    Shapes: q ``[batch, q_len, q_heads, head_dim]``, k ``[batch, kv_len,
    kv_heads, head_dim]``, v ``[batch, kv_len, kv_heads, v_head_dim]``.
    ``mask_shape`` and ``bias_shape`` are ``[B|1, Hq|1, Tq, Tk]`` or None; a
    mask may also be a *key mask* ``[B|1, 1, 1, Tk]`` (:attr:`key_mask`), which
    core hands a backend as the pairwise mask it knows or as segment ids
    (:meth:`~attn_backends.Capabilities.served_call`).
    """

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    scale: float
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    segment_ids: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False
    mask_shape: tuple[int, int, int, int] | None = None
    bias_shape: tuple[int, int, int, int] | None = None
    bias_dtype: str | None = None
    softcap: float | None = None
    return_lse: bool = False
    #: The platform (cpu, gpu, tpu) the program is being lowered for, set by
    #: core when it calls ``Backend.attend``, so per-platform choices (block
    #: sizes) follow the target, not the host; None elsewhere (a backend called
    #: directly). Added within api_version 1.
    platform: str | None = None
    #: Attention dropout: the probability a (query, key) weight is dropped, in
    #: [0, 1); 0 is no dropout. Static (part of the program); its key is the
    #: ``dropout_key`` operand. Added within api_version 1.
    dropout_rate: float = 0.0

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head ``h // group``."""
        return self.q_heads // self.kv_heads

    @property
    def accumulation_dtype(self) -> str:
        """The dtype of softmax, accumulation and lse: float32, or float64 for a
        float64 call (x64). Added within api_version 1."""
        return "float64" if self.dtype in WIDE_DTYPES else "float32"

    @property
    def offset(self) -> int:
        """``Tk - Tq``: causal and window are aligned bottom-right by it."""
        return self.kv_len - self.q_len

    @property
    def is_empty(self) -> bool:
        """True when the output or the key set is empty (B, Tq or Tk is 0)."""
        return 0 in (self.batch, self.q_len, self.kv_len)

    @property
    def key_mask(self) -> bool:
        """The mask is the same for every query row and head: ``[B|1, 1, 1, Tk]``."""
        return self.mask_shape is not None and self.mask_shape[1:3] == (1, 1)

    @property
    def features(self) -> frozenset[str]:
        """The subset of :data:`FEATURES` this call uses."""
        used = {
            "gqa": self.group > 1,
            "causal": self.causal,
            "window": self.window is not None,
            "segment_ids": self.segment_ids,
            "lengths": self.q_lengths or self.kv_lengths,
            "mask": self.mask_shape is not None,
            "bias": self.bias_shape is not None,
            "softcap": self.softcap is not None,
            "return_lse": self.return_lse,
            "dropout": self.dropout_rate > 0,
        }
        return frozenset(f for f, on in used.items() if on)

    def describe(self) -> str:
        """One line for people: shapes, dtype and the features used."""
        text = (
            f"q[{self.batch},{self.q_len},{self.q_heads},{self.head_dim}] "
            f"kv[{self.batch},{self.kv_len},{self.kv_heads},{self.head_dim}/{self.v_head_dim}] "
            f"{self.dtype}"
        )
        extras = []
        for feature in FEATURES:
            if feature in self.features:
                extras.append({"window": f"window={self.window}",
                               "dropout": f"dropout={self.dropout_rate}"}.get(feature, feature))
        return text + (" " + " ".join(extras) if extras else "")


class Operands(NamedTuple):
    """The optional arrays of a call; None where not given.

    q_segment_ids ``[B, Tq]`` int, kv_segment_ids ``[B, Tk]`` int,
    q_lengths ``[B]`` int, kv_lengths ``[B]`` int, mask ``[B|1, Hq|1, Tq, Tk]``
    bool (or a key mask ``[B|1, 1, 1, Tk]``, never handed to a backend as
    such), bias ``[B|1, Hq|1, Tq, Tk]`` float, dropout_key the PRNG key of a
    dropout call (a typed key array of shape ``[]`` or a raw ``uint32[2]``).
    """

    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    mask: Any = None
    bias: Any = None
    dropout_key: Any = None


def _dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name


def bindable(dtype: str) -> bool:
    """Whether a call in ``dtype`` binds here: one of :data:`DTYPES`, or one of
    :data:`WIDE_DTYPES` while JAX keeps it (``jax_enable_x64``)."""
    if dtype in DTYPES:
        return True
    if dtype not in WIDE_DTYPES:
        return False
    import jax

    # Under x64 JAX keeps float64; without it every jnp op would quietly
    # compute float32 (only a NumPy array or ShapeDtypeStruct arrives so).
    return bool(jax.dtypes.canonicalize_dtype(np.dtype(dtype)) == np.dtype(dtype))


def _check_float(name: str, dt: str) -> None:
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


def _require_array(name: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
            f"{name}: expected an array (jax.Array, numpy array or ShapeDtypeStruct), "
            f"got {type(x).__name__}. Wrap it with jnp.asarray(...)."
        )


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_array(name, x)
        if len(x.shape) != 4:
            raise ValueError(
                f"{name}: expected rank 4 [B, T, H, D] (BTNH layout, as "
                f"jax.nn.dot_product_attention), got shape {_shape(x)}"
            )
    dtypes = {n: _dtype_name(x) for n, x in (("q", q), ("k", k), ("v", v))}
    for name, dt in dtypes.items():
        _check_float(name, dt)
    if len(set(dtypes.values())) > 1:
        raise ValueError(
            f"q, k, v: expected one dtype, got q={dtypes['q']}, k={dtypes['k']}, "
            f"v={dtypes['v']}. Cast them to the same dtype."
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if any(n < 0 for n in _shape(x)):
            raise ValueError(f"{name}: expected sizes >= 0, got shape {list(_shape(x))}")
    (bq, tq, hq, d), (bk, tk, hk, dk), (bv, tv, hv, _) = map(_shape, (q, k, v))
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


def _check_int_array(
    name: str, x: Any, shape: tuple[int, ...], heads: tuple[int, ...] = ()
) -> None:
    _require_array(name, x)
    if _shape(x) != shape:
        hint = _bhtd_suspect(_shape(x)[1:], heads) if heads else ""
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(_shape(x))}{hint}")
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise ValueError(f"{name}: expected an integer dtype, got {_dtype_name(x)}")


def _check_pairwise(
    name: str, x: Any, b: int, hq: int, hkv: int, tq: int, tk: int, *, key_mask: bool = False
) -> tuple[int, int, int, int]:
    """The shape of a ``[B|1, Hq|1, Tq, Tk]`` array (``key_mask``: or ``[B|1, 1, 1, Tk]``)."""
    _require_array(name, x)
    shape = _shape(x)
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
            f"{also}, got {list(shape)}" + _bhtd_suspect(shape[-2:], (hq, hkv))
        )
    return shape  # type: ignore[return-value]


def _bhtd_suspect(lengths: tuple[int, ...], heads: tuple[int, ...]) -> str:
    """A hint when a wrongly shaped argument's lengths are q and k's head counts
    as BTNH reads them: q, k, v are then most likely [B, H, T, D] arrays."""
    if lengths != heads:
        return ""
    return (
        f". Its lengths {list(lengths)} are what BTNH reads as head counts: q, k, v "
        "look like [B, H, T, D] arrays; " + _BHTD_HINT
    )


def _check_scale(scale: Any, d: int) -> float:
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


def _check_window(window: Any) -> tuple[int | None, int | None] | None:
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


def _check_softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise ValueError(f"softcap: expected a static float > 0 or None, got {softcap!r}")
    if not (math.isfinite(float(softcap)) and softcap > 0):
        raise ValueError(f"softcap: expected a finite value > 0, got {softcap}")
    return float(softcap)


def _is_typed_key(x: Any) -> bool:
    import jax

    return bool(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def _check_dropout(rate: Any, key: Any) -> float:
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
    _require_array("dropout_key", key)
    typed = _is_typed_key(key)
    raw = not typed and _dtype_name(key) == "uint32" and _shape(key) == (2,)
    if not raw and not (typed and _shape(key) == ()):
        raise ValueError(
            "dropout_key: expected one PRNG key, a typed key array of shape [] "
            "(jax.random.key(seed)) or a raw uint32[2] key (jax.random.PRNGKey(seed)), "
            f"got {key.dtype} of shape {list(_shape(key))}"
        )
    return rate


def bind(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    segment_ids: tuple[Any, Any] | None = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    mask: Any = None,
    bias: Any = None,
    softcap: float | None = None,
    return_lse: bool = False,
    dropout_rate: float = 0.0,
    dropout_key: Any = None,
) -> tuple[AttentionCall, Operands]:
    """Validate the arguments of ``attention(...)`` and normalise them.

    Returns ``(call, operands)``. Raises ``ValueError`` for any bad argument.
    """
    _check_qkv(q, k, v)
    b, tq, hq, d = _shape(q)
    tk, hkv, dv = _shape(v)[1:]
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
        _check_int_array("segment_ids[0] (q_ids)", q_ids, (b, tq), (hq,))
        _check_int_array("segment_ids[1] (kv_ids)", kv_ids, (b, tk), (hkv,))
    if q_lengths is not None:
        _check_int_array("q_lengths", q_lengths, (b,))
    if kv_lengths is not None:
        _check_int_array("kv_lengths", kv_lengths, (b,))
    mask_shape = bias_shape = bias_dtype = None
    if mask is not None:
        mask_shape = _check_pairwise("mask", mask, b, hq, hkv, tq, tk, key_mask=True)
        if _dtype_name(mask) != "bool":
            raise ValueError(
                f"mask: expected dtype bool (True = visible), got {_dtype_name(mask)}; "
                "for additive masks use bias="
            )
    if bias is not None:
        bias_shape = _check_pairwise("bias", bias, b, hq, hkv, tq, tk)
        bias_dtype = _dtype_name(bias)
        _check_float("bias", bias_dtype)
    call = AttentionCall(
        batch=b,
        q_len=tq,
        kv_len=tk,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        dtype=_dtype_name(q),
        scale=_check_scale(scale, d),
        causal=bool(causal),
        window=_check_window(window),
        segment_ids=segment_ids is not None,
        q_lengths=q_lengths is not None,
        kv_lengths=kv_lengths is not None,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        bias_dtype=bias_dtype,
        softcap=_check_softcap(softcap),
        return_lse=bool(return_lse),
        dropout_rate=_check_dropout(dropout_rate, dropout_key),
    )
    return call, Operands(q_ids, kv_ids, q_lengths, kv_lengths, mask, bias, dropout_key)
