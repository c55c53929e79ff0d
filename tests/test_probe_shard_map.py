"""One persistent probe cache as a user lives with it, with calls made inside and
outside a ``jax.shard_map(check_vma=True)``: a backend passed over inside (its
manifest does not claim ``check_vma``) is never probed there, never quarantined,
and still serves the calls outside, across shapes and a new process's registry."""

from __future__ import annotations

import attn_backends as ab
import jax
import numpy as np
import pytest
from _support import Plugin, make_backend, qkv
from attn_backends.probe import prober as _probe
from attn_backends_contracts._oracle import attention as oracle
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P


def _registry() -> ab.Registry:
    # Real probes against the oracle; "fast" outranks "typed" but cannot run
    # inside a check_vma shard_map (check_vma not claimed).
    fast = make_backend("fast", priority=90)
    typed = make_backend("typed", priority=10, check_vma=True)
    return ab.Registry(plugins=[Plugin(fast, typed)], autoload=False)


def test_passed_over_inside_a_shard_map_is_never_quarantined(isolated_cache):
    att = _registry().get(device="cpu")
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("user",), axis_types=(AxisType.Auto,))
    inside = jax.jit(jax.shard_map(lambda q, k, v: att(q, k, v, causal=True), mesh=mesh,
                                   in_specs=P("user"), out_specs=P("user"), check_vma=True))
    outside = jax.jit(lambda q, k, v: att(q, k, v, causal=True))
    for seed, t in enumerate((8, 24, 40)):
        q, k, v = qkv(tq=t, tk=t, seed=seed)
        want = oracle(*(np.asarray(x) for x in (q, k, v)), causal=True)[0]
        with pytest.warns(ab.FallbackWarning, match="fast.*check_vma=True"):
            np.testing.assert_allclose(inside(q, k, v), want, atol=2e-5)
        np.testing.assert_allclose(outside(q, k, v), want, atol=2e-5)
        assert att.explain(q, k, v, causal=True).chosen == "fast"
    assert _probe.quarantined() == []
    assert list((isolated_cache / "probes").glob("*.json"))  # the verdicts were kept
    # A new process's registry on the same cache: "fast" is served from its verdict.
    q, k, v = qkv(tq=24, tk=24, seed=1)
    assert _registry().get(device="cpu").explain(q, k, v, causal=True).chosen == "fast"
