"""One probe run: the backend on its canonical probe call, against the float64 oracle.

Compares the output, lse (when the call returns it) and every gradient the
backend declares (dq, dk, dv, and dbias with ``bias_grad``) with
:func:`attn_backends.tolerances.compare`, the one comparison and tolerance
table shared with the conformance suite, with the size of the terms summed
into each element as its scale (:func:`attn_backends.oracle.magnitudes`).
So a gradient that is zero in exact arithmetic (a row that sees one key)
is not read as a large relative error, while a wrong mask, a lost rescale or
an overwritten accumulator (errors of the order of the terms) still is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..choose.dispatch import served_operands
from ..contract.backend import Backend
from ..contract.call import AttentionCall, Operands
from ..contract.environment import local_device
from . import call as _probe_call
from . import oracle
from .tolerances import compare, tolerance

#: Outputs in the order they are reported.
ORDER = ("out", "lse", "dq", "dk", "dv", "dbias")


def probe_call(backend: Backend, call: AttentionCall) -> AttentionCall | None:
    """The canonical call for ``call``, scaled up until ``backend.check`` accepts it
    (as core hands it over: ``Capabilities.served_call``)."""
    for scale_up in _probe_call.SCALE_UPS:
        small = _probe_call.canonical(call, scale_up)
        if not backend.check(backend.capabilities.served_call(small)):
            return small
    return None


#: Keep fractions further than this many standard deviations from ``1 - rate``
#: fail a dropout probe (a mask that keeps everything, or drops too much).
KEEP_SIGMAS = 6.0


def dropout_reasons(backend: Backend, call: AttentionCall, key: Any) -> tuple[list[str], Any]:
    """Whether ``backend.dropout_keep(call, key)`` can be the keep-mask of ``call``:
    (reasons it cannot, the mask as NumPy bool ``[B, Hq, Tq, Tk]`` or None).

    Its shape and dtype, its keep fraction within :data:`KEEP_SIGMAS` binomial
    standard deviations of ``1 - rate``, and a different key giving a different
    mask. That ``attend`` applies exactly this mask is judged by comparing it
    with the oracle under the mask.
    """
    shape = (call.batch, call.q_heads, call.q_len, call.kv_len)
    keep = np.asarray(backend.dropout_keep(call, key))
    if keep.shape != shape or keep.dtype != bool:
        return [f"dropout_keep returned {keep.dtype} {list(keep.shape)}, expected bool "
                f"{list(shape)}"], None
    rate, n = call.dropout_rate, keep.size
    sigma = (n * rate * (1 - rate)) ** 0.5
    kept, want = int(keep.sum()), n * (1 - rate)
    reasons = []
    if abs(kept - want) > KEEP_SIGMAS * sigma + 1:
        reasons.append(f"dropout_keep keeps {kept} of {n} weights, expected {want:.0f} "
                       f"+- {KEEP_SIGMAS * sigma:.0f} at dropout_rate={rate}")
    other = np.asarray(key).copy()
    other[-1] ^= np.uint32(0x5BD1E995)
    if n >= 64 and np.array_equal(np.asarray(backend.dropout_keep(call, other)), keep):
        reasons.append("dropout_keep gives the same mask for a different key")
    return reasons, keep


def _oracle_results(
    call: AttentionCall, data: dict[str, Any], grads: tuple[str, ...], keep: Any = None
) -> tuple[dict, dict]:
    ops = dict(data["operands"])
    ops.pop("dropout_key", None)
    scales = ops.pop("k_scales", None), ops.pop("v_scales", None)
    if keep is not None:
        ops.update(dropout_rate=call.dropout_rate, dropout_keep=keep)
    kwargs = dict(scale=call.scale, causal=call.causal, window=call.window, softcap=call.softcap,
                  **ops)
    q, k, v, d_out = data["q"], data["k"], data["v"], data["d_out"]
    if call.kv_dtype is not None:  # the oracle reads the dequantized K and V, exactly
        k, v = (oracle.dequantize_rows(x, s) for x, s in zip((k, v), scales, strict=True))
    out, lse = oracle.attention(q, k, v, **kwargs)
    want: dict[str, Any] = {"out": out}
    if call.return_lse:
        want["lse"] = lse
    if grads:
        vjp = oracle.attention_vjp(q, k, v, d_out, d_lse=data["d_lse"], **kwargs)
        want.update({f"d{name}": vjp[name] for name in grads})
    scale = oracle.magnitudes(q, k, v, d_out, d_lse=data["d_lse"], **kwargs)
    return want, {name: scale[name] for name in want}


def _backend_results(
    backend: Backend, call: AttentionCall, data: dict[str, Any], grads: tuple[str, ...],
    option_sets: list[Any],
) -> list[dict[str, Any]]:
    """The backend's outputs (and gradients) under each of ``option_sets``.

    Two programs, each covering every option set: the forward alone (what
    inference compiles) and, when ``grads``, forward and backward together
    (what training compiles). They are compiled apart on purpose: XLA
    optimises each program as a whole, so a kernel can be right in one and
    wrong in the other, and a custom_vjp backend runs other code under vjp.
    """
    import jax
    import jax.numpy as jnp

    names = ("q", "k", "v") + (("bias",) if "bias" in grads else ())
    primals = [jnp.asarray(data["operands"]["bias"] if n == "bias" else data[n]) for n in names]
    cotangents = (jnp.asarray(data["d_out"]),) + (
        (jnp.asarray(data["d_lse"]),) if call.return_lse else ())

    # The backend runs the call core would hand it (a key mask as segment ids, or
    # broadcast), with the operands core would build; the oracle judges ``call``.
    served = backend.capabilities.served_call(call)

    def attend(options: Any, ops: Operands, xs: tuple[Any, ...]) -> Any:
        named = dict(zip(names, xs, strict=True))
        operands = ops._replace(bias=named["bias"]) if "bias" in named else ops
        operands = served_operands(call, served, operands)
        return backend.attend(served, named["q"], named["k"], named["v"], operands, options)

    def outputs(result: Any, suffix: str = "") -> dict[str, Any]:
        if call.return_lse:
            return {f"out{suffix}": result[0], f"lse{suffix}": result[1]}
        return {f"out{suffix}": result}

    # Every array is an argument of the jitted functions: as closure constants
    # XLA would constant-fold the whole probe at compile time (seconds).
    def forward(ops: Operands, *arrays: Any) -> list[dict[str, Any]]:
        return [outputs(attend(options, ops, arrays)) for options in option_sets]

    def training(ops: Operands, cotangent: tuple[Any, ...], *arrays: Any) -> list[dict[str, Any]]:
        got = []
        for options in option_sets:
            result, vjp = jax.vjp(lambda *xs, opts=options: attend(opts, ops, xs), *arrays)
            ct = cotangent if call.return_lse else cotangent[0]
            d = dict(zip((f"d{n}" for n in names), vjp(ct), strict=True))
            got.append({**outputs(result, "_vjp"), **d})
        return got

    ops = _probe_call.operands(data["operands"])
    results = jax.jit(forward)(ops, *primals)
    if grads:
        # Not even linearised without grads: a backend without gradients may not allow it.
        trained = jax.jit(training)(ops, cotangents, *primals)
        results = [{**a, **b} for a, b in zip(results, trained, strict=True)]
    return [{name: np.asarray(x, np.float64) for name, x in r.items()} for r in results]


def run_probe(
    backend: Backend, call: AttentionCall, platform: str, options: Any = None
) -> list[str] | None:
    """Run ``backend`` on the canonical probe call of ``call`` and compare with the oracle.

    ``options`` are the caller's options for this backend. When the backend
    declares small-tile options (:meth:`Backend.tile_small_options`), it also
    runs under those, so a probe of a few dozen tokens crosses several of its
    tiles. Returns the reasons it disagrees (empty: it agrees), or None when
    its ``check`` rejects every probe shape (nothing to compare). A dropout
    call is judged under the keep-mask the backend exposes
    (:meth:`Backend.dropout_keep`, checked by :func:`dropout_reasons`), for its
    default and small-tile options alike.
    """
    import jax

    small = probe_call(backend, call)
    if small is None:
        return None
    caps = backend.capabilities
    grads: tuple[str, ...] = ()
    if caps.differentiable and small.kv_dtype is None:  # quantized K, V: forward only
        with_bias = small.bias_shape is not None and caps.bias_grad
        grads = ("q", "k", "v") + (("bias",) if with_bias else ())
    data = _probe_call.inputs(small)
    keep = None
    if small.dropout_rate:
        with jax.default_device(local_device(platform)):
            wrong_mask, keep = dropout_reasons(backend, small, data["operands"]["dropout_key"])
        if wrong_mask:
            return [f"probe: {r}, on {small.describe()}" for r in wrong_mask]
    # Rows with no visible key are -inf - -inf in the oracle's lse algebra: by
    # design, so NumPy must not warn (callers may turn warnings into errors).
    with np.errstate(invalid="ignore", divide="ignore"):
        want, scale = _oracle_results(small, data, grads, keep)
    runs = [("", options)]
    tiled = backend.tile_small_options(caps.served_call(small))
    if tiled is not None:
        runs.append((" under its small-tile options", tiled))
    reasons = []
    # The backend learns the platform the probe is lowered for, as core's calls say it.
    target = dataclasses.replace(small, platform=platform)
    with jax.default_device(local_device(platform)):
        results = _backend_results(backend, target, data, grads, [opts for _, opts in runs])
    for (label, _), got in zip(runs, results, strict=True):
        for what in (name for name in ORDER if name in want):
            tol = tolerance(small.dtype, what, platform=platform)
            wrong = compare(what, got.get(what), want[what], tol, scale[what])
            if wrong is not None:
                reasons.append(f"probe{label}: {wrong}, on {small.describe()}")
            elif f"{what}_vjp" in got:  # said once when both programs are wrong
                wrong = compare(what, got[f"{what}_vjp"], want[what], tol, scale[what])
                if wrong is not None:
                    reasons.append(f"probe{label}, forward under jax.vjp: {wrong}, "
                                   f"on {small.describe()}")
    return reasons
