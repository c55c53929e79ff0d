"""Batch- and head-sharded inputs give the unsharded result, with no gather of q, k, v."""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends_contracts._oracle import attention as oracle
from attn_backends_contracts._oracle import attention_vjp as oracle_vjp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

SPEC = P("dp", None, "tp", None)
# Batch over dp, heads over tp; GQA 8 query heads on 4 kv heads (2 per tp shard).
B, T, HQ, HKV, D = 2, 32, 8, 4, 64
# flash_pallas caches its kernel objects by shape, and a cached kernel traced
# under one mesh fails under another ("context mesh ... should match the aval
# mesh"; reported to its owner): tests with a different mesh use other head counts.


def _mesh(axis_types: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_types, axis_types))


def _inputs(seed: int = 0, hq: int = HQ, hkv: int = HKV) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, T, hq, D)).astype(np.float32),
        rng.standard_normal((B, T, hkv, D)).astype(np.float32),
        rng.standard_normal((B, T, hkv, D)).astype(np.float32),
    )


def _collectives(compiled_text: str) -> set[str]:
    return {op for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce")
            if op in compiled_text}


@pytest.mark.parametrize("name", ["xla_native", "reference", "flash_pallas"])
def test_sharded_forward_and_grad_match_oracle_without_collectives(md_registry, name):
    mesh = _mesh(AxisType.Auto)
    sharding = NamedSharding(mesh, SPEC)
    # Auto axes hide the spec from tracers: the spec is passed explicitly.
    att = md_registry.get(backend=name, mesh=mesh, spec=SPEC)
    q, k, v = _inputs()
    d_out = np.random.default_rng(1).standard_normal((B, T, HQ, D)).astype(np.float32)

    def loss(q, k, v):
        return jnp.sum(att(q, k, v, causal=True) * d_out)

    fwd = jax.jit(lambda q, k, v: att(q, k, v, causal=True),
                  in_shardings=(sharding,) * 3, out_shardings=sharding)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)),
                   in_shardings=(sharding,) * 3, out_shardings=(sharding,) * 3)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    for fn in (fwd, grad):
        assert _collectives(fn.lower(*args).compile().as_text()) == set()
    out = fwd(*args)
    assert out.sharding.is_equivalent_to(sharding, 4)
    np.testing.assert_allclose(out, oracle(q, k, v, causal=True)[0], atol=2e-5)
    want = oracle_vjp(q, k, v, d_out, causal=True)
    for got, key in zip(grad(*args), "qkv", strict=True):
        np.testing.assert_allclose(got, want[key], atol=5e-5, err_msg=key)


@pytest.mark.parametrize("name", ["xla_native", "reference"])
def test_partitionable_backends_on_explicit_axes(md_registry, name):
    # jax.make_mesh's default axes are Explicit: eager, and jit and grad under
    # set_mesh (as docs/MANY_CHIPS.md tells users), with GQA and return_lse.
    mesh = _mesh()
    sharding = NamedSharding(mesh, SPEC)
    att = md_registry.get(backend=name)
    q, k, v = _inputs(4)
    d_out = np.random.default_rng(5).standard_normal((B, T, HQ, D)).astype(np.float32)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    want_out, want_lse = oracle(q, k, v, causal=True)

    out, lse = att(*args, causal=True, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)
    assert out.sharding.spec == SPEC
    assert lse.sharding.spec == P("dp", "tp", None)

    def loss(q, k, v):
        return jnp.sum(att(q, k, v, causal=True) * d_out)

    with jax.sharding.set_mesh(mesh):
        fwd = jax.jit(lambda q, k, v: att(q, k, v, causal=True)).lower(*args).compile()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    for fn in (fwd, grad):
        assert _collectives(fn.as_text()) == set()
    np.testing.assert_allclose(fwd(*args), want_out, atol=2e-5)
    want = oracle_vjp(q, k, v, d_out, causal=True)
    for got, key in zip(grad(*args), "qkv", strict=True):
        np.testing.assert_allclose(got, want[key], atol=5e-5, err_msg=key)
        assert got.sharding.spec == SPEC, key


def test_flash_pallas_runs_inside_shard_map(md_registry):
    mesh = _mesh(AxisType.Auto)
    att = md_registry.get(backend="flash_pallas", mesh=mesh, spec=SPEC)
    q, k, v = _inputs(hq=32, hkv=16)
    text = jax.jit(lambda q, k, v: att(q, k, v)).lower(q, k, v).as_text()
    assert "shard_map" in text or "manual" in text.lower()


def test_concrete_sharding_is_read_from_the_arrays(md_registry):
    mesh = _mesh()
    sharding = NamedSharding(mesh, SPEC)
    att = md_registry.get(backend="flash_pallas")
    q, k, v = _inputs(2, hq=16, hkv=8)
    seg = np.repeat(np.array([[0] * 20 + [1] * 12]), B, axis=0).astype(np.int32)
    lengths = np.array([32, 25], np.int32)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    out = att(*args, segment_ids=(seg, seg), kv_lengths=lengths)
    assert out.sharding.spec == SPEC
    want, _ = oracle(q, k, v, segment_ids=(seg, seg), kv_lengths=lengths)
    np.testing.assert_allclose(out, want, atol=2e-5)
    explanation = att.explain(*args, segment_ids=(seg, seg), kv_lengths=lengths)
    assert "heads over tp (4)" in str(explanation)
    assert "shard_map" in explanation.as_dict()["sharding"]


def test_explicit_axes_under_jit_are_read_from_the_tracer(md_registry):
    mesh = _mesh()
    sharding = NamedSharding(mesh, SPEC)
    att = md_registry.get(backend="flash_pallas")
    q, k, v = _inputs(3, hq=24, hkv=12)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    with jax.sharding.set_mesh(mesh):
        compiled = jax.jit(lambda q, k, v: att(q, k, v, causal=True)).lower(*args).compile()
    assert _collectives(compiled.as_text()) == set()
    np.testing.assert_allclose(compiled(*args), oracle(q, k, v, causal=True)[0], atol=2e-5)


def test_heads_split_across_a_gqa_group_is_an_error_naming_the_axis(md_registry):
    mesh = jax.make_mesh((8,), ("tp",))
    att = md_registry.get(backend="flash_pallas", mesh=mesh, spec=P(None, None, "tp"))
    q = jax.ShapeDtypeStruct((1, 32, 8, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 32, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"mesh axis tp splits heads over 8 devices.*Hkv=4"):
        att(q, kv, kv)
    with pytest.raises(ValueError, match=r"mesh axis tp splits heads"):
        att.explain(q, kv, kv)


def test_unsupported_layouts_name_the_axis(md_registry):
    mesh = _mesh()
    q = jax.ShapeDtypeStruct((2, 32, 8, 64), jnp.float32)
    with pytest.raises(ValueError, match="head_dim is sharded over 'tp'"):
        md_registry.get(mesh=mesh, spec=P("dp", None, None, "tp")).explain(q, q, q)
    with pytest.raises(ValueError, match="'nope', which is not an axis of the mesh"):
        md_registry.get(mesh=mesh, spec=P("nope")).explain(q, q, q)
    with pytest.raises(ValueError, match="batch B=2 is not divisible by the 8 devices"):
        md_registry.get(mesh=mesh, spec=P(("dp", "tp"))).explain(q, q, q)
    with pytest.raises(ValueError, match="no mesh is known"):
        md_registry.get(spec=P("dp")).explain(q, q, q)


def test_k_sharded_unlike_q_is_an_error(md_registry):
    mesh = _mesh()
    q, k, v = _inputs()
    qs = jax.device_put(q, NamedSharding(mesh, SPEC))
    ks = jax.device_put(k, NamedSharding(mesh, P("dp")))
    with pytest.raises(ValueError, match=r"k: sharded as .*expected the same spec as q"):
        md_registry.get()(qs, ks, ks)
    # With spec= given, every one of q, k and v is held to it.
    asked = md_registry.get(mesh=mesh, spec=SPEC)
    kv = jax.device_put(k, NamedSharding(mesh, SPEC))
    with pytest.raises(ValueError, match=r"k: sharded as .*but spec=.* was asked for"):
        asked(qs, ks, kv)
    with pytest.raises(ValueError, match=r"v: sharded as .*but spec=.* was asked for"):
        asked(qs, kv, ks)
    with pytest.raises(ValueError, match=r"q: sharded as .*but spec=.* was asked for"):
        asked(jax.device_put(q, NamedSharding(mesh, P("dp"))), kv, kv)


def _per_device_setup(check):
    """A non-partitionable and a partitionable fake with the same ``check``, above
    a plain partitionable fallback; their Attention, sharded inputs and causal
    explanation. B=2 over dp=2 and heads 8/4 over tp=4: each device calls with
    batch 1, 2 query heads and 1 kv head."""
    from _support import Plugin, make_backend

    fakes = (make_backend("per_device", priority=30, partitionable=False, check=check),
             make_backend("partitioned", priority=20, partitionable=True, check=check),
             make_backend("plain", priority=10, partitionable=True))
    registry = ab.Registry(plugins=[Plugin(*fakes)], autoload=False, probe=None)
    mesh = _mesh()
    att = registry.get(mesh=mesh, fallback="silent")
    args = [jax.device_put(x, NamedSharding(mesh, SPEC)) for x in _inputs()]
    explanation = att.explain(*args, causal=True)
    return att, args, explanation, {v.backend: v for v in explanation.verdicts}


def test_a_backend_run_per_device_is_judged_on_the_call_each_device_makes():
    def batch_one(call):
        return [] if call.batch == 1 else [f"serves batch 1 only, got {call.batch}"]

    att, args, explanation, verdicts = _per_device_setup(batch_one)
    assert explanation.chosen == "per_device", str(explanation)
    assert "each device calling it with q[1,32,2,64] kv[1,32,1,64/64]" in str(explanation)
    # The partitionable one really gets the whole call, and cannot serve it.
    assert verdicts["partitioned"].reasons == ("serves batch 1 only, got 2",)
    out = jax.jit(lambda q, k, v: att(q, k, v, causal=True))(*args)
    np.testing.assert_allclose(out, oracle(*_inputs(), causal=True)[0], atol=2e-5)


def test_a_backend_run_per_device_is_refused_when_the_per_device_call_is_not_served():
    def eight_heads(call):
        return [] if call.q_heads == 8 else [f"needs 8 query heads, got {call.q_heads}"]

    _, _, explanation, verdicts = _per_device_setup(eight_heads)
    assert verdicts["per_device"].reasons == ("needs 8 query heads, got 2",)
    assert explanation.chosen == "partitioned", str(explanation)


def test_a_key_mask_reaches_a_per_device_segment_ids_backend_as_ids():
    """Batch over dp, heads over tp: each device rewrites its own rows of the key
    mask (example 1 sees no key) and gets the masked answer."""
    from _support import Plugin, make_backend

    fake = make_backend("ids_per_device", priority=30, partitionable=False, mask=False)
    registry = ab.Registry(plugins=[Plugin(fake)], autoload=False, probe=None)
    mesh = _mesh()
    att = registry.get(mesh=mesh, fallback="error")
    mask = np.random.default_rng(7).uniform(size=(B, 1, 1, T)) < 0.6
    mask[1] = False
    args = [jax.device_put(x, NamedSharding(mesh, SPEC)) for x in _inputs()]
    explanation = str(att.explain(*args, mask=mask))
    assert "each device calling it with q[1,32,2,64] kv[1,32,1,64/64] float32 gqa " \
        "segment_ids" in explanation and "= key mask rewritten as segment ids" in explanation
    out = jax.jit(lambda q, k, v, m: att(q, k, v, mask=m))(*args, mask)
    np.testing.assert_allclose(out, oracle(*_inputs(), mask=mask)[0], atol=2e-5)
    assert not np.any(np.asarray(out)[1])
