"""Attention dropout, for a backend whose manifest claims it (the ``dropout`` family).

The mask is random, so the oracle is judged under the backend's own:
``Backend.dropout_keep(call, key)`` must return exactly the keep-mask ``attend``
applies (forward and backward, whatever its options), and the forward and
every gradient must equal the float64 oracle's under that mask, with the
default options and the small-tile ones. That the mask is a fair draw is
checked on the mask itself: its keep fraction is binomial, its bits are
uncorrelated across batch rows, heads and tile-sized shifts of queries and
keys, and another key gives another mask. The same key gives bit-identical
results; another key, other results.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from attn_backends_contracts._oracle import attention as oracle_attention
from attn_backends_contracts._oracle import attention_vjp as oracle_vjp
from attn_backends_contracts._oracle import magnitudes
from attn_backends_contracts._runner import bound, compiled, split_kwargs
from attn_backends_contracts._session import family
from attn_backends_contracts.cases import make_inputs
from attn_backends_contracts.tolerances import compare, tolerance

#: Binomial bounds, in standard deviations: a fair mask fails one of this
#: family's statistics with a probability of about 1e-5 in all.
SIGMAS = 5.0
#: Shifts (query rows and keys) whose bits must be uncorrelated: tile sizes a
#: kernel may draw per tile (one tile's bits repeated in the next show here).
SHIFTS = (1, 8, 16, 32)


def _call(case: Any, data: dict[str, Any]) -> Any:
    import attn_backends

    return attn_backends.bind(data["q"], data["k"], data["v"], return_lse=case.return_lse,
                              **data["kwargs"])[0]


def _keep(suite: Any, case: Any, key: Any) -> np.ndarray:
    data = make_inputs(case)
    call = _call(case, data)
    keep = np.asarray(suite.backend.dropout_keep(call, key))
    shape = (call.batch, call.q_heads, call.q_len, call.kv_len)
    assert keep.shape == shape and keep.dtype == bool, (
        f"{case.id}: dropout_keep returned {keep.dtype} {list(keep.shape)}, expected bool "
        f"{list(shape)}")
    return keep


def _run(attention: Any, case: Any, data: dict[str, Any], differentiable: bool) -> dict:
    """The case's forward and (when claimed) VJP through ``attention``, jitted."""
    _, arrays, _ = split_kwargs(data["kwargs"])
    f = bound(attention, case, data)

    def program(q: Any, k: Any, v: Any, arrays: Any, d_out: Any, d_lse: Any) -> Any:
        primal = f(q, k, v, None, arrays)
        if not differentiable:
            return primal, ()
        _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, None, arrays), q, k, v)
        return primal, vjp((d_out, d_lse) if case.return_lse else d_out)

    args = (data["q"], data["k"], data["v"], arrays, data["d_out"], data["d_lse"])
    primal, grads = compiled(program, *args)(*args)
    got = {"out": primal[0] if case.return_lse else primal}
    if case.return_lse:
        got["lse"] = primal[1]
    got.update(zip(("dq", "dk", "dv"), grads, strict=False))
    return {name: np.asarray(x, np.float64) for name, x in got.items()}


def _expected(case: Any, data: dict[str, Any], keep: np.ndarray) -> tuple[dict, dict]:
    kw = {k: v for k, v in data["kwargs"].items() if v is not None and k != "dropout_key"}
    kw["dropout_keep"] = keep
    q, k, v = data["q64"], data["k64"], data["v64"]
    d_lse = data["d_lse"] if case.return_lse else None
    out, lse = oracle_attention(q, k, v, **kw)
    grads = oracle_vjp(q, k, v, data["d_out64"], d_lse=d_lse, **kw)
    want = {"out": out, "lse": lse, "dq": grads["q"], "dk": grads["k"], "dv": grads["v"]}
    return want, magnitudes(q, k, v, data["d_out64"], d_lse=d_lse, **kw)


@family("dropout")
def test_dropout_matches_oracle(attn_suite: Any, attn_dropout: Any) -> None:
    """out (lse) and dq, dk, dv equal the oracle's under the exposed keep-mask, with the
    default options and the small-tile ones (several tiles per sequence both ways)."""
    suite, case = attn_suite, attn_dropout
    data = make_inputs(case)
    call = _call(case, data)
    keep = _keep(suite, case, data["kwargs"]["dropout_key"])
    want, scale = _expected(case, data, keep)
    runs = [("", suite.attention)]
    tiles = suite.backend.tile_small_options(call)
    if tiles is not None:
        runs.append((" under its small-tile options", suite.attention_on(suite.platform, tiles)))
    wrong = []
    for label, attention in runs:
        got = _run(attention, case, data, suite.caps.differentiable)
        for name, value in got.items():
            tol = tolerance(case.dtype, name, platform=suite.platform)
            mismatch = compare(name, value, want[name], tol, scale[name])
            if mismatch is not None:
                wrong.append(f"{mismatch}{label}")
    assert not wrong, f"{case.id}, under dropout_keep's mask: " + "; ".join(wrong)


@family("dropout")
def test_dropout_reproducible(attn_suite: Any, attn_dropout: Any) -> None:
    """The same key gives bit-identical outputs and gradients; another key other ones."""
    suite, case = attn_suite, attn_dropout
    data = make_inputs(case)
    first = _run(suite.attention, case, data, suite.caps.differentiable)
    again = make_inputs(case)  # the same key value, a new array
    second = _run(suite.attention, case, again, suite.caps.differentiable)
    differ = [n for n in first if not np.array_equal(first[n], second[n], equal_nan=True)]
    assert not differ, f"{case.id}: the same dropout key gave different {differ}"
    other = dict(data, kwargs={**data["kwargs"],
                               "dropout_key": data["kwargs"]["dropout_key"] ^ np.uint32(1)})
    third = _run(suite.attention, case, other, suite.caps.differentiable)
    same = [n for n in ("out", "dq", "dk", "dv") if n in first
            and np.allclose(first[n], third[n], rtol=1e-3, atol=1e-3)]
    assert not same, f"{case.id}: another dropout key gave the same {same}"


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    a, b = a - a.mean(), b - b.mean()
    norm = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / norm) if norm else 1.0


@family("dropout")
def test_dropout_mask_statistics(attn_suite: Any, attn_dropout: Any) -> None:
    """The keep fraction is Binomial(n, 1 - rate); bits are uncorrelated across batch
    rows, heads, and shifts of queries and keys by tile sizes; another key gives an
    uncorrelated mask (each within ``SIGMAS`` standard deviations)."""
    case = attn_dropout
    key = make_inputs(case)["kwargs"]["dropout_key"]
    keep = _keep(attn_suite, case, key)
    rate, n = case.dropout_rate, keep.size
    kept, mean, sigma = int(keep.sum()), n * (1 - rate), np.sqrt(n * rate * (1 - rate))
    assert abs(kept - mean) <= SIGMAS * sigma, (
        f"{case.id}: keeps {kept} of {n} weights at dropout_rate={rate}, expected "
        f"{mean:.0f} +- {SIGMAS * sigma:.0f}")
    pairs = {"another key": (keep, _keep(attn_suite, case, key ^ np.uint32(0x9E3779B9)))}
    if keep.shape[0] > 1:
        pairs["batch rows 0 and 1"] = (keep[0], keep[1])
    if keep.shape[1] > 1:
        pairs["heads 0 and 1"] = (keep[:, 0], keep[:, 1])
    for s in SHIFTS:
        if keep.shape[2] > s:
            pairs[f"queries {s} apart"] = (keep[:, :, s:], keep[:, :, :-s])
        if keep.shape[3] > s:
            pairs[f"keys {s} apart"] = (keep[..., s:], keep[..., :-s])
    wrong = []
    for what, (a, b) in pairs.items():
        r, bound_ = _correlation(a, b), SIGMAS / np.sqrt(a.size)
        if abs(r) > bound_:
            wrong.append(f"{what}: correlation {r:.3f} (bound {bound_:.3f} over {a.size} bits)")
    assert not wrong, f"{case.id}: keep-mask bits are not independent: " + "; ".join(wrong)
