"""Heads-sharded serving: a ragged batch (prefill, chunked prefill, decode, padding
rows, NaN in every place the contract says never matters) with the KV heads of
the cache, q, k and v split over 8 devices gives the unsharded answer, with no
collective, and writes what the unsharded write writes."""

from __future__ import annotations

from typing import Any

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import INTERPRET, make_paged_backend, paged_case, paged_servers
from _support import Plugin
from attn_backends import KVCache
from attn_backends.parallel.paged import shard_paged_heads
from jax.sharding import PartitionSpec as P

PS, HQ, HKV, D = 4, 16, 8, 16
SEQS = [(5, 5), (3, 9), (1, 13), (1, 1), (0, 6)]  # prefill, chunk, decodes, no new rows
HEADS = P(None, "tp", None)
CALL = dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, dtype="float32")


BACKENDS = paged_servers(ab.Registry(probe=None), "cpu", **CALL)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("tp",))


def _collectives(text: str) -> set[str]:
    return {op for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce")
            if op in text}


def _registry_with_fake() -> ab.Registry:
    return ab.Registry(probe=None, autoload=False,
                       plugins=[Plugin(make_paged_backend("heads_first", layout="heads_first"))])


def _check(paged: Any, mesh: jax.sharding.Mesh) -> None:
    case = paged_case(SEQS, page_size=PS, hq=HQ, hkv=HKV, d=D, pad_rows=3)
    sharded = shard_paged_heads(paged, mesh, "tp")
    batch = case.batch()
    # Unsharded, on the pool with garbage.
    pool = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    want = np.asarray(jax.jit(paged.__call__)(jnp.asarray(case.q), pool, batch))
    np.testing.assert_allclose(want, case.expected(), atol=2e-5)
    # Sharded: the same pool, its arrays laid out by heads; q placed by heads.
    specs = sharded._cache_specs
    pool_s = KVCache(tuple(jax.device_put(a, jax.NamedSharding(mesh, s))
                           for a, s in zip(pool.arrays, specs, strict=True)),
                     pool.layout, pool.page_size, pool.num_pages)
    q = jax.device_put(jnp.asarray(case.q), jax.NamedSharding(mesh, HEADS))
    attend = jax.jit(sharded.__call__)
    out = attend(q, pool_s, batch)
    assert out.sharding.spec == HEADS
    assert _collectives(attend.lower(q, pool_s, batch).compile().as_text()) == set()
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6, rtol=1e-6)

    # Write through the sharded cache (padding slots write nothing), then attend.
    slots = np.concatenate([case.slots, [-1, -1]]).astype(np.int32)
    k_rows = np.concatenate([case.k_rows, np.full((2, HKV, D), np.nan, np.float32)])
    v_rows = np.concatenate([case.v_rows, np.full((2, HKV, D), np.nan, np.float32)])
    heads = jax.NamedSharding(mesh, HEADS)
    write = jax.jit(sharded.write, donate_argnums=0)
    cache = write(sharded.init_cache(case.k_pages.shape[0]), jax.device_put(k_rows, heads),
                  jax.device_put(v_rows, heads), jnp.asarray(slots))
    plain = paged.write(paged.init_cache(case.k_pages.shape[0]), k_rows, v_rows, slots)
    for got, ref in zip(paged.to_canonical(cache), paged.to_canonical(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    for a, spec in zip(cache.arrays, specs, strict=True):
        assert a.sharding.spec == spec
    np.testing.assert_allclose(np.asarray(attend(q, cache, batch)), case.expected(), atol=2e-5)


def test_the_installed_paged_backends_include_reference_and_xla_native() -> None:
    assert {"reference", "xla_native"} <= set(BACKENDS)


@pytest.mark.parametrize("name", BACKENDS)
def test_heads_sharded_batch_gives_the_unsharded_answer(md_registry, name, monkeypatch) -> None:
    for switch in INTERPRET:
        monkeypatch.setenv(switch, "1")
    paged = md_registry.get_paged(device="cpu", backend=name, **CALL)
    _check(paged, _mesh())


def test_a_layout_of_its_own_splits_on_its_heads_axis() -> None:
    paged = _registry_with_fake().get_paged(device="cpu", **CALL)
    assert paged.layout == "heads_first"
    sharded = shard_paged_heads(paged, _mesh(), "tp")
    assert sharded._cache_specs == (P("tp", None, None, None),) * 2
    _check(paged, _mesh())


def test_a_layout_that_does_not_keep_heads_in_blocks_is_refused() -> None:
    fake = make_paged_backend("reversed_heads", layout="reversed_heads")

    class Reversed(type(fake)):
        """Canonical, but the kv heads stored last to first."""

        def from_canonical(self, call, k_pages, v_pages):  # type: ignore[no-untyped-def]
            arrays = tuple(x[:, :, ::-1] for x in (k_pages, v_pages))
            return KVCache(arrays, "reversed_heads", call.page_size, k_pages.shape[0])

        def to_canonical(self, call, cache):  # type: ignore[no-untyped-def]
            return tuple(x[:, :, ::-1] for x in cache.arrays)

    registry = ab.Registry(probe=None, autoload=False, plugins=[Plugin(Reversed())])
    paged = registry.get_paged(device="cpu", **CALL)
    with pytest.raises(ValueError, match="does not keep kv heads in contiguous blocks"):
        shard_paged_heads(paged, _mesh(), "tp")


def test_kv_heads_not_a_multiple_of_the_axis_is_refused(md_registry) -> None:
    paged = md_registry.get_paged(device="cpu", backend="reference", num_q_heads=12,
                                  num_kv_heads=4, head_dim=D, page_size=PS, dtype="float32")
    with pytest.raises(ValueError, match="num_kv_heads=4 must be a multiple of the 8 devices"):
        shard_paged_heads(paged, _mesh(), "tp")


@pytest.mark.parametrize("name, kv_dtype", [("reference", "int8"), ("xla_native", "int8"),
                                               ("xla_native", "float8_e4m3fn")])
def test_a_quantized_cache_splits_over_heads_with_its_scales(md_registry, name,
                                                             kv_dtype) -> None:
    """A quantized cache's values and scales split over the heads axis: each device
    quantizes its own heads (a scale per position and head needs no other's), so
    the sharded write equals the unsharded one bitwise, and so does the attention
    up to float32 rounding (one jitted program against eager calls)."""
    paged = md_registry.get_paged(device="cpu", backend=name, kv_dtype=kv_dtype, **CALL)
    sharded = shard_paged_heads(paged, _mesh(), "tp")
    assert len(sharded._cache_specs) == 4
    case = paged_case(SEQS, page_size=PS, hq=HQ, hkv=HKV, d=D, pad_rows=3,
                      kv_dtype=kv_dtype)
    heads = jax.NamedSharding(_mesh(), HEADS)
    slots = np.concatenate([case.slots, [-1]]).astype(np.int32)
    k_rows, v_rows = (np.concatenate([x, np.full((1, HKV, D), np.nan, np.float32)])
                      for x in (case.k_rows, case.v_rows))
    cache = jax.jit(sharded.write, donate_argnums=0)(
        sharded.init_cache(case.k_pages.shape[0]), jax.device_put(k_rows, heads),
        jax.device_put(v_rows, heads), jnp.asarray(slots))
    plain = paged.write(paged.init_cache(case.k_pages.shape[0]), k_rows, v_rows, slots)
    for got, ref in zip(paged.to_canonical(cache), paged.to_canonical(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    q = jax.device_put(jnp.asarray(case.q), heads)
    out = np.asarray(jax.jit(sharded.__call__)(q, cache, case.batch()))
    unsharded = np.asarray(paged(jnp.asarray(case.q), plain, case.batch()))
    np.testing.assert_allclose(out, unsharded, atol=1e-6, rtol=1e-6)
    kp, vp, ks, vs = (np.asarray(x) for x in paged.to_canonical(plain))
    from attn_backends.oracle import paged_attention as oracle

    want = oracle(case.q, kp * ks[..., None].astype(np.float64),
                  vp * vs[..., None].astype(np.float64), case.cu_q_lens, case.kv_lens,
                  case.page_table, case.num_seqs)
    np.testing.assert_allclose(out, want, atol=2e-5)
