"""Sharded calls as JAX users write them, on every backend that runs on cpu.

A matrix: how the mesh is known (``jax.set_mesh``, the legacy ``with mesh:``,
no context at all: the mesh taken from the arrays, concrete when eager and
abstract under jit), its axis types (Explicit, Auto, a mix), with and without
``spec=``/``mesh=`` given to ``registry.get``, and attention called inside the
user's own ``jax.shard_map``; x every cpu backend (the Pallas ones in interpret
mode) x eager and ``jit``. Each output is checked against the float64 oracle
and its sharding against q's. No case enters a mesh context unless that is
the case under test.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from attn_backends import FallbackWarning, UnsupportedError
from attn_backends.contract import jax_api
from attn_backends_contracts._oracle import attention as oracle
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

BACKENDS = ["reference", "xla_native", "native_cpu", "example_dense", "tokamax_xla",
            "tokamax_xla_chunked", "flash_pallas", "flash_triton", "tokamax_mosaic_tpu"]
if jax.__version_info__ < (0, 12):
    # It refuses jax 0.10, where the suite failed its backward (plugins/tokamax).
    BACKENDS.remove("tokamax_mosaic_tpu")
if jax_api.pallas_triton_ops_gone():
    # Its kernel is gone from jax >= 0.12 (refused there): make test's
    # multidevice-compat runs it on the jax 0.10 line.
    BACKENDS.remove("flash_triton")
#: Backends whose kernels JAX cannot trace inside shard_map with check_vma=True
#: (their plugins' READMEs; their manifests do not claim check_vma): refused
#: there with UnsupportedError naming the fix, passed over when not pinned.
NO_VMA = {"flash_pallas", "flash_triton", "tokamax_mosaic_tpu"}
# flash_triton's kernel wants Tq == Tk and a head dim of 64 or more; four kv
# heads so that every head split keeps whole query groups.
B, T, HQ, HKV, D = 4, 32, 8, 4, 64
SPEC = P("dp", None, "tp", None)
E, A = AxisType.Explicit, AxisType.Auto


def _mesh(*types: AxisType) -> jax.sharding.Mesh:
    # Four of the folder's eight devices, as a user with four chips has.
    return jax.make_mesh((2, 2), ("dp", "tp"), axis_types=types, devices=jax.devices()[:4])


@contextlib.contextmanager
def _legacy(mesh: jax.sharding.Mesh) -> Iterator[None]:
    # Deprecated on jax 0.12 (a DeprecationWarning), still what older code does.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            yield


#: name -> (mesh axis types, the mesh context, what registry.get is given).
CASES: dict[str, tuple[tuple[AxisType, ...], str, str]] = {
    "explicit-no-context": ((E, E), "none", "nothing"),
    "explicit-set_mesh": ((E, E), "set_mesh", "nothing"),
    "explicit-no-context-spec-given": ((E, E), "none", "spec"),
    "auto-no-context": ((A, A), "none", "nothing"),
    "auto-with-mesh-legacy-spec-given": ((A, A), "with_mesh", "spec"),
    "auto-no-context-mesh-and-spec-given": ((A, A), "none", "mesh_and_spec"),
    "mixed-no-context": ((E, A), "none", "nothing"),
    "mixed-no-context-spec-given": ((E, A), "none", "spec"),
    "mixed-set_mesh-mesh-and-spec-given": ((E, A), "set_mesh", "mesh_and_spec"),
}


def _context(kind: str, mesh: Any) -> Any:
    if kind == "set_mesh":
        return jax.set_mesh(mesh)
    if kind == "with_mesh":
        return _legacy(mesh)
    return contextlib.nullcontext()


def _inputs(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32)
                 for shape in ((B, T, HQ, D), (B, T, HKV, D), (B, T, HKV, D)))


@pytest.fixture(autouse=True)
def _triton_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    # md_registry's flash_pallas runs interpreted; flash_triton likewise here.
    monkeypatch.setenv("ATTN_BACKENDS_TRITON_INTERPRET", "1")


def _run(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", BACKENDS)
def test_sharded_call_as_users_write_it(md_registry, name, case, mode):
    types, context, given = CASES[case]
    mesh = _mesh(*types)
    get = {"nothing": {}, "spec": {"spec": SPEC}, "mesh_and_spec": {"mesh": mesh, "spec": SPEC}}
    att = md_registry.get(device="cpu", backend=name, **get[given])
    q, k, v = _inputs(BACKENDS.index(name))
    sharding = NamedSharding(mesh, SPEC)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    with _context(context, mesh):
        out = _run(mode, lambda q, k, v: att(q, k, v, causal=True), *args)
    np.testing.assert_allclose(np.asarray(out), oracle(q, k, v, causal=True)[0], atol=2e-5)
    # Under jit an Auto axis is XLA's to lay out (the types name Explicit axes
    # only): q's Explicit axes must be the output's, the rest may be either way.
    typed = NamedSharding(mesh, P("dp" if types[0] == E else None, None,
                                  "tp" if types[1] == E else None, None))
    assert out.sharding.is_equivalent_to(sharding, 4) or (
        mode == "jit" and out.sharding.is_equivalent_to(typed, 4)), (out.sharding, sharding)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("name", BACKENDS)
def test_attention_inside_the_users_shard_map(md_registry, name, check_vma, mode):
    # MaxText's way: the model's own shard_map over an Auto mesh; attention sees
    # each device's examples and heads and must not shard again.
    mesh = _mesh(A, A)
    att = md_registry.get(device="cpu", backend=name)
    q, k, v = _inputs(BACKENDS.index(name) + 20)
    # Lengths where claimed: an operand of its own, sharded over the batch.
    claimed = md_registry.backend(name).capabilities.lengths
    lengths = np.array([T, 5, 17, 1] if claimed else [T] * B, np.int32)
    spec = P("dp", None, "tp", None)

    def body(q: Any, k: Any, v: Any, lengths: Any) -> Any:
        assert q.shape == (B // 2, T, HQ // 2, D)  # per device
        return att(q, k, v, causal=True, kv_lengths=lengths if claimed else None)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P("dp")),
                           out_specs=spec, check_vma=check_vma)
    if check_vma and name in NO_VMA:
        with pytest.raises(UnsupportedError, match="check_vma=False to that shard_map"):
            _run(mode, mapped, q, k, v, lengths)
        return
    out = _run(mode, mapped, q, k, v, lengths)
    want = oracle(q, k, v, causal=True, kv_lengths=lengths)[0]
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("types", [(E, E), (A, A)], ids=["explicit", "auto"])
@pytest.mark.parametrize("name", BACKENDS)
def test_inside_a_shard_map_over_some_axes_the_others_are_still_sharded(md_registry, name,
                                                                       types, check_vma):
    # The user's shard_map is manual over "dp" only; q, k, v are also split over
    # "tp", which attention still sees as a sharding (its own map or XLA's).
    mesh = _mesh(*types)
    att = md_registry.get(device="cpu", backend=name, **({} if types[1] == E else
                                                        {"spec": P(None, None, "tp", None)}))
    q, k, v = _inputs(BACKENDS.index(name) + 100)
    sharding = NamedSharding(mesh, SPEC)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    mapped = jax.jit(jax.shard_map(lambda q, k, v: att(q, k, v, causal=True), mesh=mesh,
                                   in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"},
                                   check_vma=check_vma))
    if check_vma and name in NO_VMA:
        with pytest.raises(UnsupportedError, match="check_vma=False to that shard_map"):
            mapped(*args)
        return
    out = mapped(*args)
    np.testing.assert_allclose(np.asarray(out), oracle(q, k, v, causal=True)[0], atol=2e-5)


@pytest.mark.parametrize("layout", ["alike", "q-over-sequence"])
@pytest.mark.parametrize("name", [n for n in BACKENDS if n not in NO_VMA])
def test_gradients_inside_the_users_shard_map(md_registry, name, layout):
    # jax.grad through the user's shard_map against the oracle's VJP, on 4 devices.
    # "alike": q, k, v split over batch and heads. "q-over-sequence": q's rows
    # split over "sp", k and v replicated over it, so each device's dk and dv are
    # partial and JAX must sum them over "sp" (the transpose of core's cast).
    from attn_backends_contracts._oracle import attention_vjp as oracle_vjp

    att = md_registry.get(device="cpu", backend=name)
    q, k, v = _inputs(BACKENDS.index(name) + 80)
    d_out = np.random.default_rng(81).standard_normal(q.shape).astype(np.float32)
    if layout == "alike":
        mesh = _mesh(A, A)
        q_spec = kv_spec = P("dp", None, "tp", None)
    else:
        mesh = jax.make_mesh((2, 2), ("dp", "sp"), axis_types=(A, A), devices=jax.devices()[:4])
        q_spec, kv_spec = P("dp", "sp", None, None), P("dp", None, None, None)
    mapped = jax.shard_map(lambda q, k, v: att(q, k, v), mesh=mesh,
                           in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return (mapped(q, k, v) * d_out).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = oracle_vjp(q, k, v, d_out)
    for got, key in zip(grads, "qkv", strict=True):
        np.testing.assert_allclose(np.asarray(got), want[key], atol=1e-4, err_msg=key)


def test_a_backend_that_cannot_run_in_shard_map_is_passed_over_loudly(md_registry):
    # Preferred, flash_pallas would serve the call; inside a check_vma shard_map
    # selection moves on, warning with the reason, and says so in explain.
    att = md_registry.get(device="cpu", prefer=("flash_pallas",))
    mesh = _mesh(A, A)
    q, k, v = _inputs(60)
    seen = {}

    def body(q: Any, k: Any, v: Any) -> Any:
        seen["explanation"] = att.explain(q, k, v, causal=True)
        return att(q, k, v, causal=True)

    spec = P("dp", None, "tp", None)
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    with pytest.warns(FallbackWarning, match="flash_pallas.*check_vma=True"):
        out = mapped(q, k, v)
    np.testing.assert_allclose(np.asarray(out), oracle(q, k, v, causal=True)[0], atol=2e-5)
    explanation = seen["explanation"]
    assert explanation.chosen not in NO_VMA
    assert "Capabilities.check_vma" in str(explanation)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", ["xla_native", "native_cpu", "flash_pallas"])
def test_ring_with_no_mesh_context(md_registry, name, mode):
    # The sequence over "sp" of a mesh known only from the arrays (Explicit).
    mesh = jax.make_mesh((2, 2), ("dp", "sp"), axis_types=(E, E), devices=jax.devices()[:4])
    sharding = NamedSharding(mesh, P("dp", "sp", None, None))
    att = md_registry.get(device="cpu", backend=name, sequence_axis="sp")
    q, k, v = _inputs(BACKENDS.index(name) + 40)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    out = _run(mode, lambda q, k, v: att(q, k, v, causal=True), *args)
    np.testing.assert_allclose(np.asarray(out), oracle(q, k, v, causal=True)[0], atol=2e-5)
    assert out.sharding.is_equivalent_to(sharding, 4)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("types", [(E,), (A,)], ids=["explicit", "auto"])
@pytest.mark.parametrize("name", ["xla_native", "native_cpu"])
def test_paged_with_a_sharded_cache_and_no_mesh_context(md_registry, name, types, mode):
    import jax.numpy as jnp
    from _paged_support import paged_case
    from attn_backends import KVCache
    from attn_backends.parallel.paged import shard_paged_heads

    mesh = jax.make_mesh((4,), ("tp",), axis_types=types, devices=jax.devices()[:4])
    paged = md_registry.get_paged(device="cpu", backend=name, num_q_heads=HQ,
                                  num_kv_heads=HKV, head_dim=16, page_size=4, dtype="float32")
    case = paged_case([(5, 5), (3, 9), (1, 13), (0, 6)], page_size=4, hq=HQ, hkv=HKV, d=16,
                      pad_rows=2)
    served = shard_paged_heads(paged, mesh, "tp")
    pool = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    pool = KVCache(tuple(jax.device_put(a, NamedSharding(mesh, s))
                         for a, s in zip(pool.arrays, served._cache_specs, strict=True)),
                   pool.layout, pool.page_size, pool.num_pages)
    heads = NamedSharding(mesh, P(None, "tp", None))
    q = jax.device_put(jnp.asarray(case.q), heads)
    out = _run(mode, served.__call__, q, pool, case.batch())
    np.testing.assert_allclose(np.asarray(out), case.expected(), atol=2e-5)
    assert out.sharding.is_equivalent_to(heads, 3)


PAGED_CALL = dict(num_q_heads=HQ // 4, num_kv_heads=HKV // 4, head_dim=16, page_size=4,
                  dtype="float32")


def _paged_backends() -> list[str]:
    import attn_backends as ab
    from _paged_support import paged_servers

    return paged_servers(ab.Registry(probe=None), "cpu", **PAGED_CALL)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("name", _paged_backends())
def test_paged_inside_the_users_shard_map(md_registry, name, check_vma, mode):
    # A serving engine's own shard_map over the kv heads: each device's paged call
    # sees its heads of q and of the cache (the batch replicated).
    import jax.numpy as jnp
    from _paged_support import paged_case

    mesh = jax.make_mesh((4,), ("tp",), axis_types=(A,), devices=jax.devices()[:4])
    paged = md_registry.get_paged(device="cpu", backend=name, **PAGED_CALL)
    case = paged_case([(5, 5), (3, 9), (1, 13), (0, 6)], page_size=4, hq=HQ, hkv=HKV, d=16,
                      pad_rows=2)

    def step(q: Any, k_pages: Any, v_pages: Any, batch: Any) -> Any:
        return paged(q, paged.from_canonical(k_pages, v_pages), batch)

    heads = P(None, None, "tp", None)
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(None, "tp"), heads, heads, P()),
                           out_specs=P(None, "tp"), check_vma=check_vma)
    args = (jnp.asarray(case.q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
            case.batch())
    if check_vma and not paged.backend.paged_capabilities.check_vma:
        with pytest.raises(UnsupportedError, match="check_vma=False to that shard_map"):
            _run(mode, mapped, *args)
        return
    out = _run(mode, mapped, *args)
    np.testing.assert_allclose(np.asarray(out), case.expected(), atol=2e-5)
