"""One attention call through the installed registry, against jax.nn's attention.

Run by run.sh with the fresh venv's python. ``jax.nn.dot_product_attention`` is
the oracle (independent of this repo's code): causal self-attention with GQA,
where its top-left causal equals the contract's bottom-right one. The call
must be served by ``native_cpu`` in the full install (priority 60 on cpu), by
``xla_native`` in the ``[xla]`` one (50, above reference's 0), and its gradient
must be finite.
"""

from __future__ import annotations

import sys

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np

q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32)
           for i, shape in enumerate([(2, 96, 8, 32), (2, 96, 2, 32), (2, 96, 2, 32)]))
attention = attn_backends.registry.get(device="cpu")
explanation = attention.explain(q, k, v, causal=True)
expected = "native_cpu" if sys.argv[1] == "full" else "xla_native"
assert explanation.chosen == expected, (
    f"expected {expected} to serve the call ({sys.argv[1]} install), got "
    f"{explanation.chosen}:\n{explanation}"
)
out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)
want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
error = float(np.max(np.abs(np.asarray(out) - np.asarray(want))))
assert error < 1e-4, f"out differs from jax.nn.dot_product_attention by {error:.3g}"
dq = jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q)
assert bool(jnp.isfinite(dq).all()), "dq is not finite"
print(f"one call: served by {explanation.chosen}, max |out - jax.nn| = {error:.2g}")
