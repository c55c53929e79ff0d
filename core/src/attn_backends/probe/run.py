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

    ops = operands(data["operands"])
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
    data = inputs(small)
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


def _segments(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Two contiguous segments per row, each of at least a third of ``length``."""
    ids = np.zeros((batch, length), np.int32)
    if length >= 3:
        for b in range(batch):
            ids[b, rng.integers(length // 3, length - length // 3 + 1):] = 1
    return ids


def _lengths_of_rows(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Row 0 one short of ``length``, the others from its upper half.

    Row 0 keeps the causal diagonal and the window inside the visible keys
    (a length drawn from the upper half of a long Tk often lies left of a
    short Tq's diagonal, hiding a causal bug) and shows an off-by-one length
    even when ``length`` is 1 (then it is 0: a row that sees nothing).
    """
    rows = rng.integers((length + 1) // 2, length + 1, (batch,))
    rows[0] = length - 1
    return rows.astype(np.int32)


def inputs(call: AttentionCall, seed: int = 0) -> dict[str, Any]:
    """Random NumPy inputs for ``call``: ``q, k, v, d_out, d_lse`` and the operands.

    q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``, d_out
    like the output, d_lse ``[B, Hq, Tq]`` (None unless the call returns
    lse); a dropout call's operands hold a raw ``uint32[2]`` ``dropout_key``, a
    quantized one's (``call.kv_dtype``) k and v values and their float32
    ``k_scales``, ``v_scales`` ``[B, Tk, Hkv]``.
    Floating arrays are already rounded to the call's dtype, so the float64
    oracle sees exactly what the backend sees. Rows see several keys
    wherever the call's shape allows: lengths are long (:func:`_lengths_of_rows`),
    segments are long, masks keep most keys.
    """
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy (a jax dependency)

    rng = np.random.default_rng(seed)
    b, tq, tk = call.batch, call.q_len, call.kv_len

    def normal(*shape: int, dtype: str = call.dtype) -> np.ndarray:
        return rng.normal(size=shape).astype(dtype)

    arrays: dict[str, Any] = {
        "q": normal(b, tq, call.q_heads, call.head_dim),
        "k": normal(b, tk, call.kv_heads, call.head_dim),
        "v": normal(b, tk, call.kv_heads, call.v_head_dim),
        "d_out": normal(b, tq, call.q_heads, call.v_head_dim),
        "d_lse": (
            rng.normal(size=(b, call.q_heads, tq)).astype(call.accumulation_dtype)
            if call.return_lse else None
        ),
    }
    ops: dict[str, Any] = {}
    if call.segment_ids:
        ops["segment_ids"] = (_segments(rng, b, tq), _segments(rng, b, tk))
    if call.q_lengths:
        ops["q_lengths"] = _lengths_of_rows(rng, b, tq)
    if call.kv_lengths:
        ops["kv_lengths"] = _lengths_of_rows(rng, b, tk)
    if call.mask_shape is not None:
        ops["mask"] = rng.random(call.mask_shape) < 0.8
    if call.bias_shape is not None:
        ops["bias"] = normal(*call.bias_shape, dtype=call.bias_dtype or "float32")
    if call.dropout_rate:
        # A raw key (jax.random.PRNGKey's layout), so the inputs stay NumPy.
        ops["dropout_key"] = np.array([0, seed + 1], np.uint32)
    if call.kv_dtype is not None:  # quantized K and V: values and scales, the contract's rule
        from .paged_inputs import quantize_rows

        for name in ("k", "v"):
            arrays[name], ops[f"{name}_scales"] = quantize_rows(arrays[name], call.kv_dtype)
    arrays["operands"] = ops
    return arrays


def operands(ops: dict[str, Any]) -> Operands:
    """The :class:`Operands` of :func:`inputs`' operands, as JAX arrays."""
    import jax.numpy as jnp

    out = Operands()
    if "segment_ids" in ops:
        q_ids, kv_ids = ops["segment_ids"]
        out = out._replace(q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
    for name in ("q_lengths", "kv_lengths", "mask", "bias", "dropout_key", "k_scales",
                 "v_scales"):
        if name in ops:
            out = out._replace(**{name: jnp.asarray(ops[name])})
    return out
