"""The forward alone, compiled as inference compiles it, against the float64 oracle.

Calls of a few query rows once came back wrong from a forward-only program
(errors of 0.3 to 1.6 on values of order 1) while the same forward inside a
forward+backward program, and op by op, was right: XLA optimises each
program as a whole. So these calls are checked in a program holding only
the forward.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends_contracts._oracle import attention

# (Tq, Hq, Hkv, Tk): the calls that were wrong, and a blockwise one beside them.
CALLS = [(6, 8, 2, 16), (1, 8, 2, 40), (1, 8, 2, 300), (6, 2, 2, 300), (9, 8, 2, 77)]


@pytest.mark.parametrize("tq,hq,hkv,tk", CALLS)
def test_forward_only_program_matches_the_oracle(tq, hq, hkv, tk):
    attn = ab.Registry(probe=None, only=["xla_native"]).get(device="cpu", backend="xla_native")
    rng = np.random.default_rng(tq * 1000 + tk)
    q = rng.normal(size=(1, tq, hq, 16)).astype(np.float32)
    k, v = (rng.normal(size=(1, tk, hkv, 16)).astype(np.float32) for _ in range(2))
    out = jax.jit(attn)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    want, _ = attention(q, k, v)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=1e-5)
