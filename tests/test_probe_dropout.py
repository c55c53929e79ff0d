"""Probes of dropout calls judge a backend under the keep-mask it exposes.

A dropout call must never be served by a backend whose dropout is broken, and
a good backend must never be quarantined for it: the probe compares ``attend``
with the float64 oracle under ``Backend.dropout_keep`` (so a correct backend
agrees whatever mask it draws) and checks the mask itself (its keep fraction,
and that another key gives another mask).
"""

from __future__ import annotations

import warnings

import attn_backends as ab
import jax
import numpy as np
import pytest
from _support import Plugin

pytest.importorskip("attn_backend_xla_native")
pytest.importorskip("attn_backend_reference")

from attn_backend_reference import ReferenceBackend  # noqa: E402
from attn_backend_xla_native._plugin import XlaNativeBackend  # noqa: E402


class KeyIgnored(XlaNativeBackend):
    """Draws its mask from a fixed key; exposes the mask of the caller's key."""

    name = "dropout_key_ignored"

    def attend(self, call, q, k, v, operands, options=None):
        fixed = operands._replace(dropout_key=jax.random.PRNGKey(1234))
        return super().attend(call, q, k, v, fixed, options)


class KeepsAll(XlaNativeBackend):
    """Drops nothing but rescales, and exposes the all-kept mask that makes this
    consistent: the oracle agrees with it, only the mask's statistics do not."""

    name = "dropout_keeps_all"

    def attend(self, call, q, k, v, operands, options=None):
        import dataclasses

        plain = dataclasses.replace(call, dropout_rate=0.0)
        v = v / (1.0 - call.dropout_rate)
        return super().attend(plain, q, k, v, operands._replace(dropout_key=None), options)

    def dropout_keep(self, call, key):
        import jax.numpy as jnp

        return jnp.ones((call.batch, call.q_heads, call.q_len, call.kv_len), bool)


def _served(tmp_path, monkeypatch, *backends, priority_first=True):
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    registry = ab.Registry(plugins=[Plugin(*backends)], autoload=False)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 40, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 40, 2, 8)).astype(np.float32) for _ in range(2))
    attention = registry.get(device="cpu")
    kwargs = dict(causal=True, dropout_rate=0.2, dropout_key=jax.random.key(7))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = attention.backend_for(ab.bind(q, k, v, **kwargs)[0])
    return chosen.name, [str(w.message) for w in caught]


def test_good_dropout_backend_is_served(tmp_path, monkeypatch):
    name, warned = _served(tmp_path, monkeypatch, XlaNativeBackend(), ReferenceBackend())
    assert name == "xla_native" and not warned, warned


@pytest.mark.parametrize("broken", [KeyIgnored, KeepsAll], ids=lambda c: c.name)
def test_broken_dropout_backend_is_quarantined(broken, tmp_path, monkeypatch):
    broken.priority = {"cpu": 90}
    name, warned = _served(tmp_path, monkeypatch, broken(), ReferenceBackend())
    assert name == "reference", name
    assert any(broken.name in w and "probe" in w for w in warned), warned
