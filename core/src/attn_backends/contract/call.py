"""The attention contract (api_version 1): validate user arguments once.

:class:`AttentionCall` is a call's static description (shapes, dtypes and
flags, what the selector and every backend read), :class:`Operands` its
optional arrays. ``bind`` (``contract/arguments.py``, loaded by the first call)
makes both from the arguments of ``attention(q, k, v, ...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import numpy as np

#: The contract's version this core defines (``Backend.api_version`` names the one a
#: backend implements; a backend of another version is not registered).
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
#: The dtypes K and V (a dense call's, or a paged cache's,
#: ``PagedCall.kv_dtype``) may be stored quantized in: int8 (symmetric,
#: round to nearest even) and the two float8 formats, each position's K and V
#: of each kv head with one float32 scale (docs/DESIGN.md, "Quantized caches");
#: the attention is that of the dequantized values.
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")


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
    #: One of :data:`QUANTIZED_KV_DTYPES` when K and V arrive quantized
    #: (values in it, their scales the ``k_scales``/``v_scales`` operands;
    #: attention is defined on ``value * scale``, forward only); None when K and V
    #: are in :attr:`dtype`. Added within api_version 1.
    kv_dtype: str | None = None

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
        if self.kv_dtype is not None:
            extras.insert(0, f"kv={self.kv_dtype}")
        return text + (" " + " ".join(extras) if extras else "")


class MaskKeywords(TypedDict, total=False):
    """The keywords of ``attention(q, k, v, ...)`` that say which keys each query
    sees (docs/DESIGN.md, section 2): the float64 oracle's ``visibility``."""

    causal: bool
    window: tuple[int | None, int | None] | None
    segment_ids: tuple[Any, Any] | None
    q_lengths: Any
    kv_lengths: Any
    mask: Any


class LogitKeywords(MaskKeywords, total=False):
    """With those, the keywords that shape the weights: the oracle's ``attention``."""

    scale: float | None
    bias: Any
    softcap: float | None
    dropout_rate: float


class AttentionKeywords(LogitKeywords, total=False):
    """Every keyword of ``attention(q, k, v, ...)``: the one definition the public
    call (:class:`~attn_backends.Attention`), :func:`~attn_backends.bind`, the
    float64 oracle and the command line's call flags share. Defaults:
    :data:`KEYWORD_DEFAULTS`."""

    return_lse: bool
    dropout_key: Any
    k_scales: Any
    v_scales: Any


#: Each keyword's value when the caller leaves it out.
KEYWORD_DEFAULTS: dict[str, Any] = {
    "scale": None, "causal": False, "window": None, "segment_ids": None, "q_lengths": None,
    "kv_lengths": None, "mask": None, "bias": None, "softcap": None, "return_lse": False,
    "dropout_rate": 0.0, "dropout_key": None, "k_scales": None, "v_scales": None,
}


def keywords(given: Mapping[str, Any], accepted: type, where: str) -> dict[str, Any]:
    """``given`` and the default of every other keyword in ``accepted`` (one of the
    TypedDicts above); a TypeError names a keyword ``where`` does not take."""
    names = accepted.__annotations__
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{where} got unexpected keyword argument(s) {unknown}; it takes "
                        f"{', '.join(names)}")
    return {name: given.get(name, KEYWORD_DEFAULTS[name]) for name in names}


class Operands(NamedTuple):
    """The optional arrays of a call; None where not given.

    q_segment_ids ``[B, Tq]`` int, kv_segment_ids ``[B, Tk]`` int,
    q_lengths ``[B]`` int, kv_lengths ``[B]`` int, mask ``[B|1, Hq|1, Tq, Tk]``
    bool (or a key mask ``[B|1, 1, 1, Tk]``, never handed to a backend as
    such), bias ``[B|1, Hq|1, Tq, Tk]`` float, dropout_key the PRNG key of a
    dropout call (a typed key array of shape ``[]`` or a raw ``uint32[2]``),
    k_scales and v_scales ``[B, Tk, Hkv]`` float32 the scales of quantized K
    and V (``call.kv_dtype``).
    """

    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    mask: Any = None
    bias: Any = None
    dropout_key: Any = None
    k_scales: Any = None
    v_scales: Any = None


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


def __getattr__(name: str) -> Any:
    if name == "QUANTIZED_CACHE_DTYPES":  # its name before 0.2
        from .errors import renamed

        renamed(name, "QUANTIZED_KV_DTYPES")
        return QUANTIZED_KV_DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
