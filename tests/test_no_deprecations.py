"""What a user's ``python -W error::DeprecationWarning`` sees: nothing.

A user whose own tests turn deprecation warnings into errors, on the jax, flax
and tokamax the repository locks, makes a plain call (forward and gradient), a
sharded call over a mesh, a flax module's call and a tokamax_xla call (whose
import must not warn either: tokamax's own deprecated use is filtered, see
plugins/tokamax) through the registry, in a
fresh process (warnings JAX gives once per process are seen), with probes on
and a fresh cache. jax 0.12.1 deprecated ``jax.sharding.SingleDeviceSharding``,
which core tested on every call: 268 failures of the suite on that day.
Each result is checked against ``jax.nn.dot_product_attention``, so the calls
really ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import attn_backends as ab

rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((2, 24, 4, 16), np.float32)) for _ in range(3))
want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
att = ab.registry.get(device="cpu")

out = jax.jit(lambda q, k, v: att(q, k, v, causal=True))(q, k, v)
np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
grads = jax.grad(lambda q: att(q, k, v, causal=True).sum())(q)
want_grads = jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True).sum())(q)
np.testing.assert_allclose(grads, want_grads, atol=2e-4, rtol=1e-3)

mesh = jax.make_mesh((2,), ("data",))
placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
sharded = att(*placed, causal=True)
np.testing.assert_allclose(sharded, want, atol=2e-5, rtol=1e-4)
assert len(sharded.sharding.device_set) == 2, sharded.sharding

from flax import nnx
from attn_backends_flax import attention_fn
layer = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False,
                               attention_fn=attention_fn(device="cpu"), rngs=nnx.Rngs(0))
x = jnp.asarray(rng.standard_normal((2, 12, 32), np.float32))
theirs = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False,
                                rngs=nnx.Rngs(0))
np.testing.assert_allclose(layer(x), theirs(x), atol=2e-5, rtol=1e-4)
tokamax = ab.registry.get(device="cpu", backend="tokamax_xla")
np.testing.assert_allclose(tokamax(q, k, v, causal=True), want, atol=2e-5, rtol=1e-4)
print("served:", att.explain(q, k, v, causal=True).chosen)
"""


def test_plain_sharded_and_flax_calls_raise_no_deprecation_warning(tmp_path: Path) -> None:
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(tmp_path / "cache"),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    env.pop("ATTN_BACKENDS_ONLY", None)
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", SCRIPT],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "served: " in done.stdout, done.stdout
