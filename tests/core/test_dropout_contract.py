"""The dropout arguments of the contract: what bind accepts and refuses, and who serves it.

Numbers (the oracle under the exposed mask, the mask's statistics) are the
conformance suite's ``dropout`` family; here, the call's rules.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import Plugin, make_backend

Q = jax.ShapeDtypeStruct((2, 8, 4, 8), jnp.float32)
KV = jax.ShapeDtypeStruct((2, 8, 2, 8), jnp.float32)


def test_rate_and_key_become_the_call_and_its_operand() -> None:
    key = jax.random.key(3)
    call, ops = ab.bind(Q, KV, KV, dropout_rate=0.25, dropout_key=key)
    assert call.dropout_rate == 0.25 and "dropout" in call.features
    assert ops.dropout_key is key and "dropout=0.25" in call.describe()
    raw, _ = ab.bind(Q, KV, KV, dropout_rate=0.25, dropout_key=jax.random.PRNGKey(3))
    assert raw == call  # the key is an operand, not part of the static call
    plain, ops = ab.bind(Q, KV, KV)
    assert plain.dropout_rate == 0.0 and "dropout" not in plain.features
    assert ops.dropout_key is None


@pytest.mark.parametrize("kwargs, message", [
    ({"dropout_rate": 0.1}, r"dropout_key: dropout_rate=0.1 needs a PRNG key"),
    ({"dropout_key": jax.random.PRNGKey(0)}, r"given with dropout_rate=0"),
    ({"dropout_rate": 1.0, "dropout_key": jax.random.PRNGKey(0)}, r"in \[0, 1\), got 1.0"),
    ({"dropout_rate": -0.1, "dropout_key": jax.random.PRNGKey(0)}, r"in \[0, 1\)"),
    ({"dropout_rate": True, "dropout_key": jax.random.PRNGKey(0)}, r"static Python float"),
    ({"dropout_rate": jnp.float32(0.1), "dropout_key": jax.random.PRNGKey(0)},
     r"static Python float"),
    ({"dropout_rate": 0.1, "dropout_key": np.zeros(2, np.int32)},
     r"raw uint32\[2\] key .* got int32 of shape \[2\]"),
    ({"dropout_rate": 0.1, "dropout_key": jax.random.split(jax.random.key(0))},
     r"typed key array of shape \[\] .* shape \[2\]"),
    ({"dropout_rate": 0.1, "dropout_key": 7}, r"dropout_key: expected an array"),
])
def test_bad_dropout_arguments_say_what_was_expected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ab.bind(Q, KV, KV, **kwargs)


def test_a_backend_not_claiming_dropout_is_never_handed_a_dropout_call() -> None:
    plain = make_backend("no_dropout", priority=50)
    registry = ab.Registry(plugins=[Plugin(plain)], autoload=False, probe=None)
    q, k, v = (jnp.ones(s.shape, s.dtype) for s in (Q, KV, KV))
    with pytest.raises(ab.NoBackendError, match="feature 'dropout' not supported"):
        registry.get(device="cpu")(q, k, v, dropout_rate=0.1, dropout_key=jax.random.key(0))
    with pytest.raises(ab.UnsupportedError, match="feature 'dropout' not supported"):
        registry.get(device="cpu", backend="no_dropout")(
            q, k, v, dropout_rate=0.1, dropout_key=jax.random.key(0))


def test_sharded_and_ring_attention_refuse_dropout() -> None:
    mesh = jax.make_mesh((1,), ("sp",))
    attention = ab.registry.get(device="cpu", mesh=mesh, sequence_axis="sp")
    q, k, v = (jnp.ones(s.shape, s.dtype) for s in (Q, KV, KV))
    with pytest.raises(ab.UnsupportedError, match="single device only"):
        attention(q, k, v, dropout_rate=0.1, dropout_key=jax.random.key(0))
