"""Local work without processes: process 0 of two (``process_count`` patched),
agreeing through a fake coordination store whose other process never offers, so
every call that reaches the agreement fails on its timeout (0.05 s) with the
message; a call chosen here alone publishes nothing. tests/multihost runs the
same with real processes (test_multihost_local.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import attn_backends as ab
import jax
import numpy as np
import pytest
from _paged_support import make_paged_backend
from _support import Plugin, make_backend, qkv
from attn_backends.choose import attention as choosing_attention
from attn_backends.choose import registry as choosing
from attn_backends.choose.local import is_local, spans
from attn_backends.choose.select import LOCAL_WORK
from attn_backends.contract import environment
from attn_backends.oracle import paged_case
from attn_backends.parallel.hosts import Hosts
from attn_backends_contracts._oracle import attention as oracle

PAGED = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


class Silent:
    """JAX's coordination store in a run whose other process never offers."""

    def __init__(self) -> None:
        self.published: list[str] = []

    def key_value_set(self, key: str, value: str) -> None:
        self.published.append(key)

    def key_value_try_get(self, key: str) -> str:
        raise RuntimeError(f"NOT_FOUND: {key}")

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")


@pytest.fixture
def two(monkeypatch):
    """A registry (a dense fake, a paged fake) as process 0 of 2, and its store."""
    monkeypatch.setattr(choosing_attention, "process_count", lambda: 2)
    monkeypatch.setattr(environment, "process_count", lambda: 2)
    store = Silent()
    registry = choosing.Registry(
        plugins=[Plugin(make_backend("x", priority=5), make_paged_backend("p", priority=1))],
        autoload=False)
    registry.features.replace("hosts", Hosts(store=store, process=0, count=2, timeout_s=0.05))
    return registry, store


def test_an_eager_call_on_this_processs_arrays_is_chosen_here_with_no_exchange(two):
    registry, store = two
    attention = registry.get(device="cpu")
    q, k, v = qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8)
    np.testing.assert_allclose(attention(q, k, v), oracle(q, k, v)[0], atol=1e-5)
    # jax.grad without jit: each operation runs on the values, here.
    jax.grad(lambda q: attention(q, k, v).sum())(q)
    assert "hosts: local work, not agreed" in str(attention.explain(q, k, v))
    assert store.published == []


def test_a_traced_call_is_agreed_unless_marked_and_each_is_traced_apart(two):
    registry, store = two
    attention = registry.get(device="cpu")
    q, k, v = qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8)
    step = jax.jit(lambda q, k, v: attention(q, k, v))
    with pytest.raises(ab.AgreementError) as unmarked:
        step(q, k, v)
    message = str(unmarked.value)
    assert "no offer from process(es) [1] within 0.05 s" in message
    assert "except local work" in message and "with attn_backends.local_work():" in message
    published = len(store.published)
    with ab.local_work():
        np.testing.assert_allclose(step(q, k, v), oracle(q, k, v)[0], atol=1e-5)
    assert len(store.published) == published
    # Outside again: neither jit's trace nor the selection made inside is reused.
    with pytest.raises(ab.AgreementError):
        step(q, k, v)
    assert len(store.published) == published + 1


def test_paged_attention_got_inside_local_work_is_chosen_here(two):
    registry, store = two
    with ab.local_work():
        paged = registry.get_paged(**PAGED)
    assert paged.local and paged.explain().agreement == LOCAL_WORK
    assert store.published == []
    with pytest.raises(ab.AgreementError, match="local_work"):
        registry.get_paged(**PAGED)
    # Local for its lifetime: traced under a mesh of more devices than here, refused.
    case = paged_case([(2, 3)], page_size=4, hq=4, hkv=2, d=8)
    cache = paged.write(paged.init_cache(case.k_pages.shape[0]), case.k_rows, case.v_rows,
                        case.slots)
    batch = case.batch()
    with _larger_mesh() as size, pytest.raises(ab.UnsupportedError, match=(
            rf"paged attention .* \(call\) is local work .* the abstract mesh in context has "
            f"{size} devices")):
        jax.jit(paged.__call__)(case.q, cache, batch)


@contextlib.contextmanager
def _larger_mesh() -> Iterator[int]:
    """An abstract mesh in context of more devices than this process has: its size."""
    size = jax.local_device_count() + 1
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((size,), ("x",))):
        yield size


def test_a_marked_call_on_a_mesh_larger_than_this_process_is_refused(two):
    registry, _ = two
    attention = registry.get(device="cpu")
    q, k, v = qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8)
    with ab.local_work(), _larger_mesh() as size, pytest.raises(ab.UnsupportedError, match=(
            f"is local work .* spans processes: the abstract mesh in context has {size} "
            f"devices, more than this process's {size - 1}")):
        jax.jit(lambda q: attention(q, k, v))(q)


def _on_process_1() -> SimpleNamespace:
    """An array JAX would hold on a device of process 1."""
    device = SimpleNamespace(process_index=1)
    return SimpleNamespace(sharding=SimpleNamespace(device_set=[device]))


def test_an_operand_on_another_process_is_agreed_and_refused_when_marked():
    arrays = {"q": np.zeros(2), "k": _on_process_1()}
    assert spans(arrays) == ["k is on devices of process(es) [1]"]
    assert not is_local("a call", arrays)
    with ab.local_work(), pytest.raises(ab.UnsupportedError, match="a call is local work"):
        is_local("a call", arrays)
    # What JAX holds or has on this process's devices is local; a shape is not.
    assert is_local("a call", {"q": np.zeros(2), "k": jax.numpy.zeros(2)})
    assert not is_local("a call", {"q": jax.ShapeDtypeStruct((2,), "float32")})


def test_one_process_has_no_local_work_to_mark():
    registry = ab.Registry(plugins=[Plugin(make_backend("x", priority=5))], autoload=False,
                           probe=None)
    q, k, v = qkv(b=1, tq=4, tk=4, hq=2, hkv=2, d=8)
    with ab.local_work():
        explanation = registry.get(device="cpu").explain(q, k, v)
    assert explanation.agreement is None and "hosts:" not in str(explanation)
