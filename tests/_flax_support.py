"""Helpers shared by test_flax.py (both jax lines) and test_flax_nnx.py."""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
from attn_backends_flax import FlaxAttention, attention_fn

REGISTRY = ab.Registry(probe=None)

#: Every installed backend that serves f32 head dim 8 with masks on cpu (both
#: environments of make test install all four; tokamax_xla is another
#: library's kernel, picked by name like ours). The adapter's mapping is the
#: same for each: the cases run on the tiled one, PRIMARY, and one case runs on
#: every backend.
BACKENDS = [b for b in ("reference", "xla_native", "example_dense", "tokamax_xla")
            if b in REGISTRY.backends]
PRIMARY = "xla_native" if "xla_native" in BACKENDS else "reference"


def _options() -> dict[str, object]:
    if "xla_native" not in REGISTRY.backends:
        return {}
    from attn_backend_xla_native import BlockConfig

    # 4x4 tiles: every sequence in these tests spans several tiles.
    return {"xla_native": BlockConfig(block_q=4, block_kv=4)}


def ours(backend: str = PRIMARY) -> FlaxAttention:
    """The adapter over ``backend`` on cpu, strict (no fallback)."""
    return attention_fn(REGISTRY.get(device="cpu", backend=backend, backend_options=_options()))


def x(seed: int, *shape: int) -> jax.Array:
    """Standard normal float32 ``shape``."""
    # NumPy, not jax.random: jax 0.10 spends seconds compiling threefry for a 5-d shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def close(a: object, b: object, atol: float, rtol: float = 1e-4) -> None:
    """Every leaf of pytree a within tolerance of b's."""
    for got, want in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=rtol)
