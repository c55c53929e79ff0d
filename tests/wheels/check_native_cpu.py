"""The native_cpu wheel as installed: its compiled library loads from the wheel,
registers its FFI targets, and serves a call and its gradient.

Run by run.sh (full variant) with the fresh venv's python; the oracle is
jax.nn.dot_product_attention (causal GQA self-attention, where its top-left
causal equals the contract's bottom-right one).
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from attn_backend_native_cpu import _library

reason = _library.load_error()
assert reason is None, f"the installed native_cpu library did not load: {reason}"
q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32)
           for i, shape in enumerate([(2, 96, 8, 32), (2, 96, 2, 32), (2, 96, 2, 32)]))
attention = attn_backends.registry.get(device="cpu", backend="native_cpu")
out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)
want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
error = float(np.max(np.abs(np.asarray(out) - np.asarray(want))))
assert error < 1e-4, f"out differs from jax.nn.dot_product_attention by {error:.3g}"
dq = jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q)
assert bool(jnp.isfinite(dq).all()), "dq is not finite"
print(f"native_cpu wheel: {_library.kernel_isa()} kernels, max |out - jax.nn| = {error:.2g}")
