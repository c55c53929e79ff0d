"""jit, vmap, grad, checkpoint, a user's shard_map, determinism, and the backend's own kernel ran.

All on :func:`~attn_backends_contracts.cases.transform_case` (batch 2, GQA and
causal when claimed).

Which lowering the ``hlo_marker`` is looked for in: a TPU kernel's marker
(``tpu_custom_call``) exists only in a TPU lowering; emulated on CPU
(interpret mode) the kernel lowers to plain HLO. So when the manifest claims
``tpu`` and the suite runs elsewhere, the marker is checked in
``jax.export.export(jax.jit(f), platforms=["tpu"])`` (selection for an absent
platform uses the manifest and serves export); otherwise in the local
lowering. The ``attn/<name>`` named scope is checked in the local lowering,
with debug info.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.authoring import jax_api

from attn_backends_contracts._runner import bound, compiled, oracle, split_kwargs
from attn_backends_contracts._session import family
from attn_backends_contracts.cases import make_inputs, transform_case
from attn_backends_contracts.tolerances import compare, tolerance


def _setup(suite: Any, name: str = "base") -> tuple[Any, dict[str, Any], Any]:
    case = replace(transform_case(suite.caps), name=name)
    data = make_inputs(case)
    _, arrays, bias = split_kwargs(data["kwargs"])
    f = bound(suite.attention, case, data)
    return case, data, lambda q, k, v: f(q, k, v, bias, arrays)


def _f64(x: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _check(suite: Any, case: Any, name: str, actual: Any, expected: np.ndarray,
           how: str) -> None:
    wrong = compare(name, _f64(actual), expected,
                    tolerance(case.dtype, name, platform=suite.platform))
    assert wrong is None, f"{how}: {wrong}"


@family("transforms")
def test_eager_and_jit(attn_suite: Any) -> None:
    """Called eagerly and under jit, the output equals the oracle."""
    case, data, f = _setup(attn_suite)
    args = tuple(jnp.asarray(data[n]) for n in ("q", "k", "v"))
    expected = oracle(case, data, differentiable=False)["out"]
    _check(attn_suite, case, "out", f(*args), expected, "eager")
    _check(attn_suite, case, "out", compiled(f, *args)(*args), expected, "jit")


@family("transforms")
def test_vmap(attn_suite: Any) -> None:
    """vmap over an extra leading batch axis equals the oracle slice by slice."""
    case, data, f = _setup(attn_suite)
    case2, data2, _ = _setup(attn_suite, "base2")
    stacked = tuple(np.stack([data[n], data2[n]]) for n in ("q", "k", "v"))
    out = compiled(jax.vmap(f), *stacked)(*stacked)
    for i, (c, d) in enumerate(((case, data), (case2, data2))):
        _check(attn_suite, c, "out", out[i], oracle(c, d, differentiable=False)["out"],
               f"vmap slice {i}")


def _grad_check(suite: Any, wrap: Any, how: str) -> None:
    if not suite.caps.differentiable:
        pytest.skip("differentiable=False: test_unclaimed checks that gradients raise")
    case, data, f = _setup(suite)
    d_out = jnp.asarray(data["d_out"], jnp.float32)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(f(q, k, v).astype(jnp.float32) * d_out)

    args = (data["q"], data["k"], data["v"])
    grads = compiled(jax.grad(wrap(loss), argnums=(0, 1, 2)), *args)(*args)
    expected = oracle(case, data, differentiable=True)
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        _check(suite, case, name, g, expected[name], how)


@family("transforms")
def test_grad(attn_suite: Any) -> None:
    """jax.grad of a loss through attention equals the oracle's VJP."""
    _grad_check(attn_suite, lambda fn: fn, "grad")


@family("transforms")
def test_checkpoint(attn_suite: Any) -> None:
    """jax.grad through jax.checkpoint (rematerialised forward) equals the oracle's VJP."""
    _grad_check(attn_suite, jax.checkpoint, "checkpoint")


@family("transforms")
def test_shard_map(attn_suite: Any) -> None:
    """Inside a user's ``jax.shard_map`` with ``check_vma=True`` (one device, so q,
    k, v vary over its manual axis): claimed (``check_vma``), the output and
    gradients equal the oracle; unclaimed, a clean UnsupportedError naming the fix."""
    from attn_backends import UnsupportedError
    from jax.sharding import Mesh, PartitionSpec

    case, data, f = _setup(attn_suite)
    caps = attn_suite.caps
    device = jax.local_devices(backend=attn_suite.platform)[0]
    mesh = Mesh(np.array([device]), ("user",), axis_types=(jax.sharding.AxisType.Auto,))
    d_out = jnp.asarray(data["d_out"])

    def body(q: Any, k: Any, v: Any, d_out: Any) -> Any:
        if not caps.differentiable:
            return f(q, k, v), ()
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    args = (data["q"], data["k"], data["v"], d_out)
    expected = oracle(case, data, differentiable=caps.differentiable)
    # k and v vary as q does, or are replicated (invariant) beside a varying q.
    split, whole = PartitionSpec("user"), PartitionSpec()
    for how, kv in (("in shard_map", split), ("in shard_map, k and v replicated", whole)):
        mapped = jax_api.shard_map(
            body, mesh=mesh, in_specs=(split, kv, kv, split),
            out_specs=(split, (split, kv, kv) if caps.differentiable else ()), check_vma=True)
        if not caps.check_vma:
            with pytest.raises(UnsupportedError, match="check_vma=False"):
                jax.jit(mapped)(*args)
            continue
        out, grads = compiled(mapped, *args)(*args)
        _check(attn_suite, case, "out", out, expected["out"], how)
        for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
            _check(attn_suite, case, name, g, expected[name], how)


@family("determinism")
def test_determinism(attn_suite: Any) -> None:
    """When claimed: two traces and two runs of forward+VJP are bitwise equal."""
    if not attn_suite.caps.deterministic:
        pytest.skip("deterministic=False in the manifest")
    case, data, f = _setup(attn_suite)
    d_out = data["d_out"]

    def program(q: Any, k: Any, v: Any) -> Any:
        if not attn_suite.caps.differentiable:
            return f(q, k, v)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)

    args = (data["q"], data["k"], data["v"])
    exe = compiled(program, *args)
    runs = [exe(*args), exe(*args)]
    # A fresh function object is traced afresh (jit caches traces per function).
    runs.append(compiled(lambda *a: program(*a), *args)(*args))
    flat = [[np.asarray(x).tobytes() for x in jax.tree.leaves(r)] for r in runs]
    assert flat[0] == flat[1] == flat[2], "deterministic=True, but repeated runs differ bitwise"


@family("hlo")
def test_lowering_names_backend(attn_suite: Any) -> None:
    """The lowered program carries the ``attn/<name>`` scope and the backend's hlo_marker."""
    backend, caps = attn_suite.backend, attn_suite.caps
    case, data, f = _setup(attn_suite)
    args = (data["q"], data["k"], data["v"])
    text = jax.jit(f).lower(*args).as_text(debug_info=True)
    assert f"attn/{backend.name}" in text, (
        f"named scope attn/{backend.name} missing from the lowered program"
    )
    marker = backend.hlo_marker
    if not marker:
        return
    where = attn_suite.platform
    if "tpu" in caps.platforms and attn_suite.platform != "tpu":
        where = "tpu"
        g = bound(attn_suite.attention_on("tpu"), case, data)
        _, arrays, bias = split_kwargs(data["kwargs"])
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        exported = jax_api.export(lambda q, k, v: g(q, k, v, bias, arrays), ["tpu"])(*specs)
        text = exported.mlir_module()
    assert marker in text, (
        f"hlo_marker {marker!r} not found in the {where} lowering: the backend's own "
        "kernel did not run (a fallback did?)"
    )
