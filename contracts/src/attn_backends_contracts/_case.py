"""One case of the suite (:class:`Case`) and the constants its inputs use.

Below both the case tables (:mod:`.cases`) and the arrays built from a case
(:mod:`._inputs`), which both need it; :mod:`.cases` re-exports all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Values written at invisible key positions for ``inputs="garbage"``: finite
#: (float16 max is 65504) and large, so a backend that lets them leak shows.
GARBAGE = 3.0e4


@dataclass(frozen=True)
class Case:
    """One attention call of the suite.

    ``head_dim`` / ``v_head_dim`` None mean "the backend's base head dim".
    ``segments``: "packed" (per-example random packing) or "disjoint" (some
    query rows share no id with any key). ``mask`` / ``bias``: "full"
    ``[B,Hq,Tq,Tk]``, "shared" ``[1,1,..]``, "per_batch" ``[B,1,..]``,
    "per_head" ``[1,Hq,..]``, or for mask "empty_rows" (full, some rows all
    False) and the key masks "key" ``[B,1,1,Tk]``, "key_shared" ``[1,1,1,Tk]``
    and "key_empty" (``[B,1,1,Tk]``, example 1 sees no key). ``inputs``:
    "normal", "large" (q, k scaled by 1e3), "equal" (every key identical:
    equal logits), "positive" (q, k, v uniform in [1, 2): large same-sign
    logits, 15 to 20 at head dim 64), "garbage" (invisible keys hold
    ``GARBAGE``).
    ``lse``: request ``return_lse`` when the backend claims it (the
    ``return_lse`` feature itself is ``return_lse``). ``tiles``: run under the
    backend's ``tile_small_options(call)`` instead of its default options.
    ``dropout_rate``: attention dropout (> 0: the call gets a ``dropout_key``).
    ``kv_dtype``: K and V quantized in it (values and ``k_scales``/``v_scales``
    by the contract's rule; the oracle reads ``value * scale``), forward only.
    """

    name: str
    family: str
    batch: int = 1
    q_len: int = 17
    kv_len: int = 17
    q_heads: int = 2
    kv_heads: int = 2
    head_dim: int | None = None
    v_head_dim: int | None = None
    dtype: str = "float32"
    scale: float | None = None
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    segments: str | None = None
    q_lengths: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None
    mask: str | None = None
    bias: str | None = None
    bias_dtype: str | None = None
    softcap: float | None = None
    return_lse: bool = False
    lse: bool = False
    inputs: str = "normal"
    quick: bool = False
    tiles: bool = False
    dropout_rate: float = 0.0
    kv_dtype: str | None = None

    @property
    def id(self) -> str:
        """Test id: ``family-name-dtype`` (``-kv_dtype`` for a quantized K and V),
        then ``-tiles`` for a tiles twin."""
        kv = f"-{self.kv_dtype}" if self.kv_dtype else ""
        return f"{self.family}-{self.name}-{self.dtype}{kv}" + ("-tiles" if self.tiles else "")

    @property
    def features(self) -> frozenset[str]:
        """The contract features (``attn_backends.FEATURES``) this case needs."""
        used = {
            "gqa": self.q_heads != self.kv_heads,
            "causal": self.causal,
            "window": self.window is not None,
            "segment_ids": self.segments is not None,
            "lengths": self.q_lengths is not None or self.kv_lengths is not None,
            "mask": self.mask is not None,
            "bias": self.bias is not None,
            "softcap": self.softcap is not None,
            "return_lse": self.return_lse,
            "dropout": self.dropout_rate > 0,
        }
        return frozenset(f for f, on in used.items() if on)
