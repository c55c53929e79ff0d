"""The output head of one decoding request in bfloat16: XLA's CPU matrix-vector product
would widen the whole 262,144 x 640 embedding to float32 each step (641 MiB, 9x
slower); the model's head pads the row to two (examples/gemma3/README.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from attn_gemma3.model import logits_of


def test_one_row_of_the_bfloat16_head_widens_nothing():
    params = {"embed": jax.ShapeDtypeStruct((262144, 640), jnp.bfloat16)}
    for rows in (1, 3):
        hidden = jax.ShapeDtypeStruct((rows, 640), jnp.float32)
        compiled = jax.jit(logits_of).lower(params, hidden).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < 16 << 20, rows


def test_the_padded_row_gives_the_rows_logits():
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((50, 8)).astype(np.float32)
    hidden = rng.standard_normal((1, 8)).astype(np.float32)
    out = logits_of({"embed": jnp.asarray(embed)}, jnp.asarray(hidden))
    assert out.shape == (1, 50)
    np.testing.assert_allclose(out, hidden @ embed.T, rtol=1e-5, atol=1e-5)
