"""The output head: the logits of each row, and the greedy token each step takes
from them, against NumPy's product and argmax (ties to the first index)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_gemma3.model import PICK_BLOCK, greedy, logits_of, next_tokens


def test_one_row_of_the_bfloat16_head_widens_nothing():
    # jax 0.12.0.1's CPU matrix-vector product widened a bfloat16 head to float32
    # (641 MiB of temporaries); from jax 0.12.1 (the distribution's floor) one row
    # is read as it is.
    params = {"embed": jax.ShapeDtypeStruct((262144, 640), jnp.bfloat16)}
    for rows in (1, 3):
        hidden = jax.ShapeDtypeStruct((rows, 640), jnp.float32)
        compiled = jax.jit(logits_of).lower(params, hidden).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < 16 << 20, rows


def test_the_head_gives_each_rows_logits():
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((50, 8)).astype(np.float32)
    for rows in (1, 3):
        hidden = rng.standard_normal((rows, 8)).astype(np.float32)
        out = logits_of({"embed": jnp.asarray(embed)}, jnp.asarray(hidden))
        assert out.shape == (rows, 50)
        np.testing.assert_allclose(out, hidden @ embed.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [300, 4 * PICK_BLOCK])  # one pass; blocks
def test_greedy_is_the_first_index_of_the_largest(vocab):
    rng = np.random.default_rng(1)
    logits = rng.integers(0, 4, size=(6, vocab)).astype(np.float32)  # many ties
    logits[2] = -np.inf
    logits[3, 7] = np.inf
    logits[4, :] = 0.0
    logits[4, [vocab - 1, vocab // 2 + 3]] = 5.0  # tied in two blocks: the first wins
    logits[5, [vocab - 2, vocab // 2 + 1]] = np.nan  # argmax: the first NaN
    for axis in (0, 1, -1):
        np.testing.assert_array_equal(greedy(jnp.asarray(logits), axis=axis),
                                      np.argmax(logits, axis=axis))
    np.testing.assert_array_equal(greedy(jnp.asarray(logits.T), axis=0), np.argmax(logits, 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_next_tokens_are_the_argmax_of_the_logits(dtype, rows):
    # float32 rows > 1 take the head on the left ([vocab, N]); the others [N, vocab]
    rng = np.random.default_rng(2)
    embed = jnp.asarray(rng.standard_normal((4096, 64)), dtype)
    hidden = rng.standard_normal((rows, 64)).astype(np.float32)
    want = np.argmax(np.asarray(hidden.astype(embed.dtype), np.float64)
                     @ np.asarray(embed, np.float64).T, axis=1)
    got = next_tokens({"embed": embed}, jnp.asarray(hidden))
    assert got.dtype == jnp.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(got, want)
