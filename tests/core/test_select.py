"""select() is a plain function of (call, platform, backends, judging)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from _support import make_backend
from attn_backends import bind
from attn_backends.choose.select import Judging, select

SDS = jax.ShapeDtypeStruct
CALL, _ = bind(SDS((1, 8, 4, 64), jnp.float32), SDS((1, 8, 2, 64), jnp.float32),
               SDS((1, 8, 2, 64), jnp.float32), causal=True)


def _select(backends, **kw):
    return select(CALL, "cpu", backends, Judging(jax_version="0.10.2", **kw))


def test_highest_priority_survivor_wins_and_order_is_explained():
    lo, hi = make_backend("lo", priority=1), make_backend("hi", priority=5)
    exp = _select([lo, hi])
    assert exp.chosen == "hi"
    assert [v.backend for v in exp.verdicts] == ["hi", "lo"]
    assert all(v.accepted for v in exp.verdicts)


def test_equal_priority_breaks_ties_by_name_deterministically():
    a, b = make_backend("b_backend"), make_backend("a_backend")
    assert _select([a, b]).chosen == _select([b, a]).chosen == "a_backend"


def test_prefer_overrides_priority():
    lo, hi = make_backend("lo", priority=1), make_backend("hi", priority=5)
    assert _select([lo, hi], prefer=["lo"]).chosen == "lo"
    assert _select([lo, hi], prefer=["not_installed", "lo"]).chosen == "lo"


def test_manifest_filters_platform_dtype_head_dim_and_features():
    from attn_backends import HeadDims

    no_causal = make_backend("no_causal", priority=9, causal=False)
    tpu_only = make_backend("tpu_only", priority=8, platforms=("tpu",))
    small = make_backend("small", priority=7)
    type(small).capabilities = type(small).capabilities.__class__(
        platforms=frozenset({"cpu"}), head_dims=HeadDims(max=32), causal=True, gqa=True
    )
    ok = make_backend("ok", priority=1)
    exp = _select([no_causal, tpu_only, small, ok])
    assert exp.chosen == "ok"
    reasons = {v.backend: v.reasons for v in exp.verdicts}
    assert reasons["no_causal"] == ("feature 'causal' not supported",)
    assert reasons["tpu_only"] == ("platform 'cpu' not in ['tpu']",)
    assert reasons["small"] == ("head_dim=64 exceeds the maximum head dim 32",)
    # Only backends that serve the platform count as passed over.
    assert [v.backend for v in exp.passed_over] == ["no_causal", "small"]


def test_check_reasons_and_a_raising_check_reject_without_crashing():
    says_no = make_backend("says_no", priority=9, check=lambda call: ["Tq too short for blocks"])

    def boom(call):
        raise RuntimeError("kaput")

    raises = make_backend("raises", priority=8, check=boom)
    exp = _select([says_no, raises, make_backend("ok", priority=1)])
    reasons = {v.backend: v.reasons for v in exp.verdicts}
    assert exp.chosen == "ok"
    assert reasons["says_no"] == ("Tq too short for blocks",)
    assert reasons["raises"] == ("check() raised RuntimeError: kaput",)


def test_jax_outside_declared_range_is_a_reason_naming_both_versions():
    old = make_backend("old", priority=9, jax_versions=">=0.4,<0.5")
    exp = _select([old, make_backend("ok", priority=1)])
    assert exp.verdicts[0].reasons == ("jax 0.10.2 is outside the supported range >=0.4,<0.5",)
    assert exp.chosen == "ok"


def test_probe_seam_runs_only_on_present_platform_survivors():
    seen = []

    def probe(backend, call, platform, options):
        seen.append((backend.name, options))
        return ["probe: output differs from reference"] if backend.name == "bad" else []

    bad, good = make_backend("bad", priority=9), make_backend("good", priority=1)
    worse = make_backend("worse", priority=0)
    exp = _select([bad, good, worse], probe=probe, options={"good": "tiles-of-8"})
    # Probed until the first accepted backend, each under the caller's options.
    assert exp.chosen == "good" and seen == [("bad", None), ("good", "tiles-of-8")]
    assert exp.verdicts[0].probed is True
    assert exp.verdicts[0].reasons == ("probe: output differs from reference",)
    assert exp.verdicts[2].accepted and exp.verdicts[2].probed is None
    assert "worse" in str(exp) and "ok (not probed: ranked below the chosen one)" in str(exp)
    seen.clear()
    absent = _select([bad, good], probe=probe, present=False)
    assert seen == [] and absent.chosen == "bad" and absent.verdicts[0].probed is None


def test_nothing_serves():
    exp = _select([make_backend("no", causal=False)])
    assert exp.chosen is None and "no backend can serve" in str(exp)
