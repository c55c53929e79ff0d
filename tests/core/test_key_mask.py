"""A key mask ``[B|1, 1, 1, Tk]`` reaches a backend that claims segment ids but not
masks as segment ids, with the masked answer (docs/DESIGN.md, sections 2 and 4)."""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import dense, make_backend, qkv
from attn_backends import oracle
from attn_backends.choose.dispatch import absent_ids
from attn_backends.probe.run import run_probe

B, TQ, TK, HQ, HKV, D = 3, 5, 11, 4, 2, 8


def _recording(name: str, seen: list, **features: bool) -> ab.Backend:
    """A dense fake that records the call and operand shapes it is handed."""

    def attend(call, q, k, v, ops):
        seen.append((call, {n: None if x is None else tuple(x.shape)
                            for n, x in ops._asdict().items()}))
        return dense(call, q, k, v, ops)

    return make_backend(name, attend=attend, **features)


def _key_mask(batch: int = B) -> np.ndarray:
    """[B, 1, 1, Tk]: row 1 sees no key at all; the others see most keys."""
    mask = np.random.default_rng(3).uniform(size=(batch, 1, 1, TK)) < 0.7
    mask[0, ..., :2] = True
    mask[1] = False
    return mask


def _segments() -> tuple[np.ndarray, np.ndarray]:
    q_ids = np.array([[0, 0, 1, 1, 1]] * B, np.int32)
    kv_ids = np.array([[0] * 5 + [1] * 6] * B, np.int32)
    return q_ids, kv_ids


@pytest.fixture
def ids_and_masker(fake_registry):
    """A registry whose top backend claims segment ids but not masks."""
    seen_ids: list = []
    seen_mask: list = []
    registry = fake_registry(_recording("ids_only", seen_ids, priority=9, mask=False),
                             _recording("masker", seen_mask, priority=1))
    return registry, seen_ids, seen_mask


@pytest.mark.parametrize("with_ids", [False, True], ids=["no-ids", "with-ids"])
def test_a_key_mask_goes_to_a_segment_ids_backend_with_the_masked_answer(ids_and_masker,
                                                                         with_ids):
    registry, seen_ids, seen_mask = ids_and_masker
    attention = registry.get(device="cpu", fallback="error")
    q, k, v = qkv(b=B, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    mask = _key_mask()
    kw = {"mask": mask, "causal": True}
    if with_ids:
        kw["segment_ids"] = _segments()
    d_out = jnp.asarray(np.random.default_rng(5).normal(size=(B, TQ, HQ, D)), jnp.float32)
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kw), q, k, v)
    dq, dk, dv = vjp(d_out)
    assert seen_mask == [] and seen_ids
    call, shapes = seen_ids[0]
    assert call.mask_shape is None and call.segment_ids and shapes["mask"] is None
    assert shapes["q_segment_ids"] == (B, TQ) and shapes["kv_segment_ids"] == (B, TK)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    want, lse = oracle.attention(*f64, **kw)
    grads = oracle.attention_vjp(*f64, np.asarray(d_out, np.float64), **kw)
    assert np.isneginf(lse[1]).all()  # the example that sees no key
    np.testing.assert_allclose(out, want, atol=1e-5)
    for got, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        np.testing.assert_allclose(got, grads[name], atol=1e-5)
    assert not np.any(np.asarray(out)[1]) and not np.any(np.asarray(dq)[1])


def test_a_shared_key_mask_with_ids_at_the_ends_of_int32(ids_and_masker):
    # Ids at the smallest int32 leave no "minimum - 1": the absent id is found elsewhere.
    registry, seen_ids, _ = ids_and_masker
    attention = registry.get(device="cpu", fallback="error")
    q, k, v = qkv(b=2, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    q_ids = np.array([[low, low, low + 1, high, high], [low] * TQ], np.int32)
    kv_ids = np.array([[low] * 4 + [low + 1] * 4 + [high] * 3, [low] * TK], np.int32)
    mask = np.random.default_rng(4).uniform(size=(1, 1, 1, TK)) < 0.6
    kw = {"mask": mask, "segment_ids": (q_ids, kv_ids)}
    got = attention(q, k, v, **kw)
    want, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), **kw)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert seen_ids


def test_absent_ids_are_held_by_no_query_row():
    low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    rows = np.array([[low, low + 1, low + 3, 0], [low, high, low + 1, low + 2],
                     [5, 5, 5, 5], [low, low + 1, low + 2, low + 3]], np.int32)
    absent = np.asarray(absent_ids(jnp.asarray(rows)))
    assert not (rows == absent[:, None]).any(axis=1).any()
    assert absent.tolist() == [low + 2, low + 3, 4, low + 4]
    one = np.asarray(absent_ids(jnp.asarray([[low], [high]], jnp.int32)))
    assert one.tolist() == [low + 1, high - 1]


def test_a_mask_claiming_backend_still_gets_the_pairwise_mask(fake_registry):
    seen: list = []
    registry = fake_registry(_recording("masker", seen, priority=5))
    q, k, v = qkv(b=B, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    mask = _key_mask()
    got = registry.get(device="cpu")(q, k, v, mask=mask)
    call, shapes = seen[0]
    assert call.mask_shape == (B, 1, TQ, TK) and shapes["mask"] == (B, 1, TQ, TK)
    assert not call.segment_ids and shapes["q_segment_ids"] is None
    want, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), mask=mask)
    np.testing.assert_allclose(got, want, atol=1e-5)
    explanation = registry.get(device="cpu").explain(q, k, v, mask=mask)
    assert all(not v.notes for v in explanation.verdicts)


def test_a_mask_that_varies_by_query_row_is_never_rewritten(ids_and_masker):
    registry, seen_ids, seen_mask = ids_and_masker
    q, k, v = qkv(b=B, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    mask = np.broadcast_to(_key_mask(), (B, 1, TQ, TK)).copy()
    mask[0, 0, 0, 0] = not mask[0, 0, 0, 0]
    attention = registry.get(device="cpu", fallback="silent")
    explanation = attention.explain(q, k, v, mask=mask)
    verdicts = {v.backend: v for v in explanation.verdicts}
    assert explanation.chosen == "masker"
    assert verdicts["ids_only"].reasons == ("feature 'mask' not supported",)
    assert verdicts["ids_only"].notes == ()
    attention(q, k, v, mask=mask)
    assert seen_ids == [] and seen_mask[0][1]["mask"] == (B, 1, TQ, TK)


def test_explain_says_the_key_mask_was_rewritten(ids_and_masker):
    registry, _, _ = ids_and_masker
    q, k, v = qkv(b=B, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    explanation = registry.get(device="cpu").explain(q, k, v, mask=_key_mask())
    verdicts = {v.backend: v for v in explanation.verdicts}
    assert explanation.chosen == "ids_only"
    assert verdicts["ids_only"].notes == ("key mask rewritten as segment ids",)
    assert verdicts["masker"].notes == ()
    assert "key mask rewritten as segment ids" in str(explanation)
    verdict = next(v for v in explanation.as_dict()["verdicts"] if v["backend"] == "ids_only")
    assert verdict["notes"] == ["key mask rewritten as segment ids"]


def test_a_key_mask_without_mask_or_segment_ids_claimed_is_refused(fake_registry):
    registry = fake_registry(make_backend("plain", mask=False, segment_ids=False))
    q, k, v = qkv(b=B, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    with pytest.raises(ab.UnsupportedError, match="feature 'mask' not supported"):
        registry.get(device="cpu", backend="plain")(q, k, v, mask=_key_mask())


def test_bind_takes_a_key_mask_and_names_it_when_the_shape_is_wrong():
    q, k, v = qkv(b=B, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D)
    call, _ = ab.bind(q, k, v, mask=jnp.ones((1, 1, 1, TK), bool))
    assert call.key_mask and call.mask_shape == (1, 1, 1, TK)
    assert not ab.bind(q, k, v, mask=jnp.ones((B, 1, TQ, TK), bool))[0].key_mask
    with pytest.raises(ValueError, match=r"or a key mask \[3\|1, 1, 1, 11\]"):
        ab.bind(q, k, v, mask=jnp.ones((B, HQ, 1, TK), bool))  # per head: not a key mask


def _ids_ignored(call, q, k, v, ops):
    return dense(call, q, k, v, ops._replace(q_segment_ids=None, kv_segment_ids=None))


def test_the_probe_runs_the_rewritten_call_against_the_masked_oracle():
    seen: list = []
    good = _recording("ids_only", seen, mask=False)
    call, _ = ab.bind(*qkv(b=2, tq=TQ, tk=TK, hq=HQ, hkv=HKV, d=D), mask=_key_mask(2))
    assert run_probe(good, call, "cpu") == []
    assert seen and all(c.segment_ids and c.mask_shape is None for c, _ in seen)
    broken = make_backend("ids_ignored", mask=False, attend=_ids_ignored)
    reasons = run_probe(broken, call, "cpu")
    assert reasons and "probe" in reasons[0]
