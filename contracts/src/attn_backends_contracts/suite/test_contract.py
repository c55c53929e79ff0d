"""What the manifest says, checked: unclaimed things raise, claimed masks take effect,
the output dtype is q's.

Unclaimed features, dtypes, platforms, head dims and gradients must raise
``attn_backends.UnsupportedError`` through the registry (strict
``backend=NAME``). The backend's ``attend`` is not called directly and need
not raise: core refuses a call that uses a feature, dtype or head dim the
manifest does not claim before ``attend`` runs (docs/DESIGN.md, sections 3-4),
so a backend is never handed a mask it would silently drop, and keeps no
copy of that rule.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_backends_contracts._inputs import x64_for
from attn_backends_contracts._runner import bound, compiled, oracle, split_kwargs
from attn_backends_contracts._session import family
from attn_backends_contracts.cases import make_inputs, single_case
from attn_backends_contracts.tolerances import tolerance


def _unclaimed_case(suite: Any, kind: str, value: str) -> Any:
    if kind == "feature":
        return single_case(suite.caps, "unclaimed", value, value)
    if kind == "dtype":
        return single_case(suite.caps, "unclaimed", value, dtype=value)
    if kind == "head_dim":
        return single_case(suite.caps, "unclaimed", value, head_dim=int(value))
    if kind == "kv_dtype":
        return single_case(suite.caps, "unclaimed", value, kv_dtype=value)
    if kind == "gradient" and value == "bias":
        return single_case(suite.caps, "unclaimed", value, "bias")
    return single_case(suite.caps, "unclaimed", value)


@family("unclaimed")
def test_unclaimed_raises(attn_suite: Any, attn_unclaimed: tuple[str, str]) -> None:
    """Anything the manifest does not claim raises UnsupportedError, never returns a number."""
    import attn_backends

    kind, value = attn_unclaimed
    case = _unclaimed_case(attn_suite, kind, value)
    data = make_inputs(case)
    _, arrays, bias = split_kwargs(data["kwargs"])
    q, k, v = data["q"], data["k"], data["v"]
    attention = attn_suite.attention_on(value) if kind == "platform" else attn_suite.attention
    f = bound(attention, case, data)
    if kind == "gradient":
        argnums = (3,) if value == "bias" else (0, 1, 2)

        def loss(q: Any, k: Any, v: Any, bias: Any) -> Any:
            return jnp.sum(f(q, k, v, bias, arrays).astype(jnp.float32))

        with pytest.raises(attn_backends.UnsupportedError):
            jax.eval_shape(jax.grad(loss, argnums), q, k, v, bias)
        return
    # Through the registry only: core refuses an unclaimed feature before the
    # backend's attend runs (docs/DESIGN.md, section 4), so backends keep no
    # copy of that rule. An unclaimed float64 is float64 only under x64.
    with x64_for(case.dtype), pytest.raises(attn_backends.UnsupportedError):
        jax.eval_shape(f, q, k, v, bias, arrays)


@family("output_dtype")
def test_output_dtype(attn_suite: Any, attn_dtype: str) -> None:
    """out has q's dtype and shape; lse is float32 ``[B, Hq, Tq]`` (float64 for float64)."""
    caps = attn_suite.caps
    case = single_case(caps, "output_dtype", attn_dtype, dtype=attn_dtype,
                       return_lse=caps.return_lse)
    data = make_inputs(case)
    _, arrays, bias = split_kwargs(data["kwargs"])
    with x64_for(attn_dtype):
        result = jax.eval_shape(bound(attn_suite.attention, case, data),
                                data["q"], data["k"], data["v"], bias, arrays)
    out = result[0] if case.return_lse else result
    b, tq, hq, dv = case.batch, case.q_len, case.q_heads, case.v_head_dim
    assert (out.dtype, out.shape) == (jnp.dtype(attn_dtype), (b, tq, hq, dv)), (
        f"out: expected {attn_dtype} {(b, tq, hq, dv)}, got {out.dtype} {out.shape}"
    )
    if case.return_lse:
        lse, want = result[1], "float64" if attn_dtype == "float64" else "float32"
        assert (lse.dtype, lse.shape) == (jnp.dtype(want), (b, hq, tq)), (
            f"lse: expected {want} {(b, hq, tq)}, got {lse.dtype} {lse.shape}"
        )


_OFF = {"causal": ("causal", False), "window": ("window", None)}


@family("mask_effect")
def test_masking_changes_output(attn_suite: Any, attn_masking: str) -> None:
    """A claimed causal/window/segment/length/mask call differs from the unmasked call."""
    case = single_case(attn_suite.caps, "mask_effect", attn_masking, attn_masking)
    data = make_inputs(case)
    _, arrays, bias = split_kwargs(data["kwargs"])
    plain_data = {**data, "kwargs": dict(data["kwargs"])}
    if attn_masking in _OFF:
        key, off = _OFF[attn_masking]
        plain_data["kwargs"][key] = off
    plain_arrays = {
        k: a for k, a in arrays.items()
        if k not in ("segment_ids", "q_lengths", "kv_lengths", "mask")
    }
    masked = bound(attn_suite.attention, case, data)
    plain = bound(attn_suite.attention, replace(case, name="plain"), plain_data)

    def both(q: Any, k: Any, v: Any) -> Any:
        return masked(q, k, v, bias, arrays), plain(q, k, v, bias, plain_arrays)

    args = (data["q"], data["k"], data["v"])
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
            for x in compiled(both, *args)(*args))
    expected = oracle(case, data, differentiable=False)["out"]
    tol = tolerance(case.dtype, "out", platform=attn_suite.platform)
    threshold = 10 * (tol.atol + tol.rtol * np.max(np.abs(expected)))
    diff = float(np.max(np.abs(a - b)))
    assert diff > threshold, (
        f"{attn_masking} given, but the output equals the unmasked call's "
        f"(max |diff| {diff:.3g} <= {threshold:.3g}): the backend ignores {attn_masking}"
    )
