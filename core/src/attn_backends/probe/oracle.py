"""NumPy float64 oracle of the attention contract (docs/DESIGN.md, "The contract").

Shares no code with any backend. Forward and a closed-form backward, both in
float64, written for clarity over speed: every quantity is dense
``[B, Hq, Tq, Tk]``. The runtime probe and the conformance suite both judge
backends against it, and :func:`magnitudes` gives the scale each compared
element is judged at. The paged oracle (:func:`paged_attention`) and the ragged
batches the paged probe and suite judge it on (:func:`paged_case`, :class:`PagedCase`)
are public here too, as are the NumPy quantizer of the quantized K and V they
are judged on (:func:`quantize_rows`) and the exact float64 dequantization the
oracle reads them by (:func:`dequantize_rows`).
"""

from __future__ import annotations

from typing import Any, Unpack

import numpy as np

from ..contract.call import LogitKeywords, MaskKeywords, keywords
from .paged_inputs import PagedCase, dequantize_rows, paged_case, quantize_rows
from .paged_oracle import paged_attention

__all__ = ["PagedCase", "attention", "attention_vjp", "dequantize_rows", "magnitudes",
           "paged_attention", "paged_case", "quantize_rows", "visibility"]


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def visibility(b: int, hq: int, tq: int, tk: int, **kwargs: Unpack[MaskKeywords]) -> np.ndarray:
    """Boolean ``[B, Hq, Tq, Tk]``: key j visible to query i, per the contract."""
    kw = keywords(kwargs, MaskKeywords, "oracle.visibility()")
    causal, window, segment_ids = kw["causal"], kw["window"], kw["segment_ids"]
    q_lengths, kv_lengths, mask = kw["q_lengths"], kw["kv_lengths"], kw["mask"]
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    diag = i + (tk - tq)
    vis = np.ones((b, hq, tq, tk), dtype=bool)
    if causal:
        vis &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            vis &= j >= diag - left
        if right is not None:
            vis &= j <= diag + right
    if segment_ids is not None:
        q_ids, kv_ids = (np.asarray(x) for x in segment_ids)
        vis &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    if kv_lengths is not None:
        vis &= (j[None] < np.asarray(kv_lengths)[:, None, None])[:, None]
    if q_lengths is not None:
        vis &= (i[None] < np.asarray(q_lengths)[:, None, None])[:, None]
    if mask is not None:
        vis &= np.asarray(mask, dtype=bool)
    return vis


def _expand_kv(x: np.ndarray, hq: int) -> np.ndarray:
    """[B, Tk, Hkv, D] -> [B, Hq, Tk, D], query head h reading kv head h // group."""
    group = hq // x.shape[2]
    return np.repeat(x, group, axis=2).transpose(0, 2, 1, 3)


def _dropout(rate: float, keep: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """The factor dropout multiplies the probabilities by, ``keep / (1 - rate)``
    ``[B, Hq, Tq, Tk]`` float64, or None without dropout."""
    if keep is None:
        if rate:
            raise ValueError(f"dropout_rate={rate} needs dropout_keep, the keep-mask")
        return None
    keep = np.asarray(keep)
    if keep.shape != shape or keep.dtype != bool:
        raise ValueError(f"dropout_keep: expected bool {list(shape)}, got {keep.dtype} "
                         f"{list(keep.shape)}")
    return keep / (1.0 - rate)


def _forward_parts(q, k, v, scale, softcap, bias, vis, drop=None):
    b, tq, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qh = q.transpose(0, 2, 1, 3)
    kh, vh = _expand_kv(k, hq), _expand_kv(v, hq)
    raw = scale * np.einsum("bhid,bhjd->bhij", qh, kh)
    tanh = None
    logits = raw
    if softcap is not None:
        tanh = np.tanh(raw / softcap)
        logits = softcap * tanh
    if bias is not None:
        logits = logits + _f64(bias)
    masked = np.where(vis, logits, -np.inf)
    any_visible = vis.any(axis=-1, keepdims=True)
    row_max = np.where(any_visible, masked.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    expd = np.where(vis, np.exp(masked - row_max), 0.0)
    total = expd.sum(axis=-1, keepdims=True)
    probs = np.where(any_visible, expd / np.where(any_visible, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(any_visible, row_max + np.log(np.where(any_visible, total, 1.0)), -np.inf)
    out = np.einsum("bhij,bhjd->bhid", probs if drop is None else probs * drop, vh)
    return scale, qh, kh, vh, tanh, probs, out, lse[..., 0]


def attention(q: Any, k: Any, v: Any, *, dropout_keep: Any = None,
              **kwargs: Unpack[LogitKeywords]) -> tuple[np.ndarray, np.ndarray]:
    """Contract attention in float64.

    q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``.
    Returns ``(out [B, Tq, Hq, Dv], lse [B, Hq, Tq])``; rows with no visible
    key give zeros and ``-inf``. With ``dropout_keep`` (bool ``[B, Hq, Tq,
    Tk]``) the probabilities are multiplied by ``keep / (1 - dropout_rate)``
    before they weigh V; lse stays that of the undropped logits.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    b, tq, hq, _ = q.shape
    vis, drop, (scale, softcap, bias) = _judged(kwargs, b, hq, tq, k.shape[1], dropout_keep,
                                                "oracle.attention()")
    *_, out, lse = _forward_parts(q, k, v, scale, softcap, bias, vis, drop)
    return out.transpose(0, 2, 1, 3), lse


def _judged(given: Any, b: int, hq: int, tq: int, tk: int, keep: Any, where: str,
            ) -> tuple[np.ndarray, np.ndarray | None, tuple[Any, Any, Any]]:
    """The visibility, the dropout factor and (scale, softcap, bias) of a call's
    keywords (:class:`~attn_backends.contract.call.LogitKeywords`)."""
    kw = keywords(given, LogitKeywords, where)
    vis = visibility(b, hq, tq, tk, **{name: kw[name] for name in MaskKeywords.__annotations__})
    return vis, _dropout(kw["dropout_rate"], keep, vis.shape), (kw["scale"], kw["softcap"],
                                                                 kw["bias"])


def _reduce_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``x`` over the axes that ``shape`` broadcasts (size 1)."""
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def attention_vjp(q: Any, k: Any, v: Any, d_out: Any, *, d_lse: Any = None,
                  dropout_keep: Any = None, **kwargs: Unpack[LogitKeywords],
                  ) -> dict[str, np.ndarray | None]:
    """Closed-form gradients of :func:`attention` in float64.

    ``d_out [B, Tq, Hq, Dv]`` and optional ``d_lse [B, Hq, Tq]`` are the
    cotangents. Returns ``{"q", "k", "v", "bias"}`` with the inputs' shapes
    (``"bias"`` is None without a bias).
    """
    q, k, v, d_out = _f64(q), _f64(k), _f64(v), _f64(d_out)
    b, tq, hq, _ = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    vis, drop, (scale, softcap, bias) = _judged(kwargs, b, hq, tq, tk, dropout_keep,
                                                "oracle.attention_vjp()")
    scale, qh, kh, vh, tanh, probs, _, _ = _forward_parts(q, k, v, scale, softcap, bias, vis,
                                                          drop)
    do = d_out.transpose(0, 2, 1, 3)
    d_probs = np.einsum("bhid,bhjd->bhij", do, vh)
    if drop is not None:
        d_probs = d_probs * drop
    d_logits = probs * (d_probs - (probs * d_probs).sum(axis=-1, keepdims=True))
    if d_lse is not None:
        finite = np.where(np.isfinite(_f64(d_lse)), _f64(d_lse), 0.0)
        d_logits = d_logits + probs * finite[..., None]
    d_bias = None if bias is None else _reduce_to(d_logits, np.shape(bias))
    d_raw = d_logits if tanh is None else d_logits * (1.0 - tanh**2)
    dq = scale * np.einsum("bhij,bhjd->bhid", d_raw, kh)
    dk_rep = scale * np.einsum("bhij,bhid->bhjd", d_raw, qh)
    dv_rep = np.einsum("bhij,bhid->bhjd", probs if drop is None else probs * drop, do)
    group = hq // hkv

    def fold(x: np.ndarray) -> np.ndarray:
        # [B, Hq, Tk, D] -> [B, Tk, Hkv, D], summing the query heads of each group.
        return x.reshape(b, hkv, group, tk, -1).sum(axis=2).transpose(0, 2, 1, 3)

    return {
        "q": dq.transpose(0, 2, 1, 3),
        "k": fold(dk_rep),
        "v": fold(dv_rep),
        "bias": d_bias,
    }


def magnitudes(q: Any, k: Any, v: Any, d_out: Any, *, d_lse: Any = None,
               dropout_keep: Any = None, **kwargs: Unpack[LogitKeywords],
               ) -> dict[str, np.ndarray | None]:
    """The size of the terms summed into each output element, in float64.

    Every output of attention is a sum (``out = P @ V``, ``dq = dS @ K``, ...).
    A kernel's rounding error in an element grows with the magnitude of the
    terms it adds, not with the (possibly cancelled, near zero) result, so the
    probe and the suite scale their relative tolerance by these: the same sums
    taken over absolute values (``|P| @ |V|``, ``|dS| @ |K|`` with
    ``|dS| = P * (|dP| + P.|dP|)``, ...). Each is >= the element's own
    magnitude. Returns ``{"out", "lse", "dq", "dk", "dv", "dbias"}`` with the
    shapes of :func:`attention` and :func:`attention_vjp` (``"dbias"`` None
    without a bias).
    """
    q, k, v, d_out = _f64(q), _f64(k), _f64(v), _f64(d_out)
    b, tq, hq, _ = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    vis, drop, (scale, softcap, bias) = _judged(kwargs, b, hq, tq, tk, dropout_keep,
                                                "oracle.magnitudes()")
    scale, qh, kh, vh, tanh, probs, _, lse = _forward_parts(q, k, v, scale, softcap, bias, vis,
                                                            drop)
    logits = scale * np.abs(np.einsum("bhid,bhjd->bhij", qh, kh))
    if bias is not None:
        logits = logits + np.abs(_f64(bias))
    largest_logit = np.where(vis, logits, 0.0).max(axis=-1, initial=0.0)
    do = np.abs(d_out.transpose(0, 2, 1, 3))
    d_probs = np.einsum("bhid,bhjd->bhij", do, np.abs(vh))
    weights = probs
    if drop is not None:
        d_probs, weights = d_probs * drop, probs * drop
    d_logits = probs * (d_probs + (probs * d_probs).sum(axis=-1, keepdims=True))
    if d_lse is not None:
        finite = np.where(np.isfinite(_f64(d_lse)), np.abs(_f64(d_lse)), 0.0)
        d_logits = d_logits + probs * finite[..., None]
    d_raw = d_logits if tanh is None else d_logits * (1.0 - tanh**2)
    group = hq // hkv

    def fold(x: np.ndarray) -> np.ndarray:
        return x.reshape(b, hkv, group, tk, -1).sum(axis=2).transpose(0, 2, 1, 3)

    return {
        "out": np.einsum("bhij,bhjd->bhid", weights, np.abs(vh)).transpose(0, 2, 1, 3),
        "lse": np.where(np.isfinite(lse), np.maximum(np.abs(lse), largest_logit), 0.0),
        "dq": scale * np.einsum("bhij,bhjd->bhid", d_raw, np.abs(kh)).transpose(0, 2, 1, 3),
        "dk": fold(scale * np.einsum("bhij,bhid->bhjd", d_raw, np.abs(qh))),
        "dv": fold(np.einsum("bhij,bhid->bhjd", weights, do)),
        "dbias": None if bias is None else _reduce_to(d_logits, np.shape(bias)),
    }
