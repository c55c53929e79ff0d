"""Ring attention (sequence sharded over a mesh axis) against the float64 oracle."""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.parallel.ring_run import _zigzag_perms
from attn_backends_contracts._oracle import attention as oracle
from attn_backends_contracts._oracle import attention_vjp as oracle_vjp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SPEC = P("dp", "sp", None, None)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("dp", "sp"))


def _data(seed: int, b: int, t: int, hq: int, hkv: int, d: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d), (b, hq, t)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _check(att, mesh, arrays, kwargs, atol):
    """Forward (out, lse) and the vjp of both against the oracle."""
    q, k, v, d_out, d_lse = arrays
    sharding = NamedSharding(mesh, SPEC)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]

    def loss(q, k, v):
        out, lse = att(q, k, v, return_lse=True, **kwargs)
        # Rows with lse = -inf carry no gradient: mask their cotangent so 0 * inf
        # never enters the sum.
        lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
        return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)

    with jax.sharding.set_mesh(mesh):
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        compiled = step.lower(*args).compile()
        grads, (out, lse) = compiled(*args)
    text = compiled.as_text()
    assert "collective-permute" in text and "all-gather" not in text
    assert out.sharding.spec == SPEC
    want_out, want_lse = oracle(q, k, v, **kwargs)
    np.testing.assert_allclose(out, want_out, atol=atol)
    np.testing.assert_allclose(lse, np.where(np.isneginf(want_lse), 0.0, want_lse), atol=atol)
    want = oracle_vjp(q, k, v, d_out, d_lse=d_lse, **kwargs)
    for got, key in zip(grads, "qkv", strict=True):
        np.testing.assert_allclose(got, want[key], atol=atol * 4, err_msg=key)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["xla_native", "reference"])
def test_ring_matches_oracle(md_registry, name, causal):
    att = md_registry.get(backend=name, sequence_axis="sp")
    _check(att, _mesh(), _data(0, 2, 64, 4, 2, 16), {"causal": causal}, 2e-5)


def test_ring_honours_segment_ids_and_lengths(md_registry):
    # ring_block=4 cuts each 8-token chunk in two: the sub-chunk loops run.
    att = md_registry.get(backend="xla_native", sequence_axis="sp", ring_block=4)
    t = 64
    seg = np.array([[0] * 21 + [1] * 30 + [2] * 13, [0] * 40 + [1] * 24], np.int32)
    kwargs = {
        "causal": True,
        "segment_ids": (seg, seg),
        "kv_lengths": np.array([50, 17], np.int32),
        "q_lengths": np.array([64, 45], np.int32),
    }
    _check(att, _mesh(), _data(1, 2, t, 4, 4, 16), kwargs, 2e-5)


def test_ring_cross_attention_in_sub_chunks(md_registry):
    """Tq != Tk without causal: per device 8 queries and 16 keys, in 4 x 8 sub-chunks."""
    att = md_registry.get(backend="xla_native", sequence_axis="sp", ring_block=8)
    rng = np.random.default_rng(4)
    q, d_out = (rng.standard_normal((2, 32, 2, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 64, 2, 16)).astype(np.float32) for _ in range(2))
    d_lse = rng.standard_normal((2, 2, 32)).astype(np.float32)
    kv_lengths = np.array([64, 21], np.int32)
    _check(att, _mesh(), [q, k, v, d_out, d_lse], {"kv_lengths": kv_lengths}, 2e-5)


def test_ring_sub_chunks_of_a_prime_chunk_length_stay_whole(md_registry):
    # T = 2 x 4 devices x 11: causal chunks of 11 tokens, a prime with no divisor
    # near ring_block=8. One 11-token sub-chunk per chunk, not eleven 1-token
    # calls (121 per pair: a prime chunk of 1031 at the default 1024 made
    # millions).
    mesh = _mesh()
    att = md_registry.get(backend="xla_native", mesh=mesh, sequence_axis="sp", ring_block=8)
    q = jax.ShapeDtypeStruct((2, 88, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 88, 1, 16), jnp.float32)
    text = str(att.explain(q, kv, kv, causal=True))
    assert "the backend gets q[2,11,2,16] kv[2,11,1,16/16]" in text
    _check(att, mesh, _data(5, 2, 88, 2, 1, 16), {"causal": True}, 2e-5)


def test_ring_over_flash_pallas_interpret(md_registry):
    att = md_registry.get(backend="flash_pallas", sequence_axis="sp")
    kv_lengths = np.array([64, 37], np.int32)
    _check(att, _mesh(), _data(2, 2, 64, 2, 1, 64),
           {"causal": True, "kv_lengths": kv_lengths}, 3e-5)


def test_ring_is_chosen_through_the_registry_and_explained(md_registry):
    mesh = _mesh()
    att = md_registry.get(mesh=mesh, sequence_axis="sp", fallback="silent")
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32)
    explanation = att.explain(q, q, q, causal=True)
    text = str(explanation)
    assert "sequence over sp (4): ring; 4 steps, zigzag order" in text
    # The first cpu backend by priority that takes part in a ring (it returns lse).
    first = "native_cpu" if "native_cpu" in md_registry.backends else "xla_native"
    assert explanation.chosen == first
    verdicts = {v.backend: v for v in explanation.verdicts}
    assert any("return_lse" in r for r in verdicts["example_dense"].reasons)
    # A backend that cannot take part is refused with the ring's reason.
    pinned = md_registry.get(mesh=mesh, sequence_axis="sp", backend="example_dense")
    with pytest.raises(ab.UnsupportedError, match="ring: partial results are merged"):
        pinned(q, q, q)


def test_ring_rejects_what_it_cannot_split(md_registry):
    att = md_registry.get(mesh=_mesh(), sequence_axis="sp")
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32)
    with pytest.raises(ab.UnsupportedError, match="does not support window"):
        att(q, q, q, window=(8, 0))
    short = jax.ShapeDtypeStruct((2, 36, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="T=36 must be divisible by 8"):
        att(short, short, short, causal=True)
    with pytest.raises(ab.UnsupportedError, match="causal needs Tq == Tk"):
        att(q, jax.ShapeDtypeStruct((2, 128, 4, 16), jnp.float32),
            jax.ShapeDtypeStruct((2, 128, 4, 16), jnp.float32), causal=True)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zigzag_gives_every_device_the_same_causal_work(p):
    """Place 2P chunks as the zigzag permutation does; count visible (q, k) chunk pairs."""
    first, second = _zigzag_perms(p)
    holds: dict[int, list[int]] = {d: [] for d in range(p)}
    for half, perm in enumerate((first, second)):
        for src, dst in perm:  # device src holds contiguous chunks 2*src and 2*src + 1
            holds[dst].append(2 * src + half)
    assert sorted(c for cs in holds.values() for c in cs) == list(range(2 * p))
    work = {d: sum(kc <= qc for qc in holds[d] for cs in holds.values() for kc in cs)
            for d in range(p)}
    assert len(set(work.values())) == 1, work


def _peak_bytes(fn, arg) -> int:
    """Per-device peak of the compiled program: arguments + outputs + temporaries - aliased."""
    m = jax.jit(fn).lower(arg, arg, arg, arg).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def test_ring_needs_at_most_a_sixth_of_one_devices_memory_at_128k(md_registry):
    """The #7 target at S=128k on 8 devices (causal, f32, B=1, H=8, D=64),
    compile only; benchmarks/bench_ring.py prints the same figures."""
    mesh = jax.make_mesh((8,), ("sp",))
    shape = (1, 131072, 8, 64)
    ring = md_registry.get(backend="xla_native", sequence_axis="sp", mesh=mesh)
    single = md_registry.get(backend="xla_native")

    def programs(att):
        def fwd(q, k, v, do):
            return att(q, k, v, causal=True)

        def fwd_bwd(q, k, v, do):
            return jax.vjp(lambda q, k, v: att(q, k, v, causal=True), q, k, v)[1](do)

        return fwd, fwd_bwd

    sharded = jax.ShapeDtypeStruct(shape, jnp.float32,
                                   sharding=NamedSharding(mesh, P(None, "sp", None, None)))
    whole = jax.ShapeDtypeStruct(shape, jnp.float32)
    with jax.sharding.set_mesh(mesh):
        for ring_fn, single_fn in zip(programs(ring), programs(single), strict=True):
            ring_peak, single_peak = _peak_bytes(ring_fn, sharded), _peak_bytes(single_fn, whole)
            assert 6 * ring_peak <= single_peak, (ring_fn.__name__, ring_peak, single_peak)
