"""Registry.get() and the Attention callable: selection, fallback, scopes, guards."""

from __future__ import annotations

import threading
import time
import warnings

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import dense, make_backend, qkv
from attn_backends import oracle
from attn_backends.choose import attention as _attention
from attn_backends.contract import jax_api
from attn_backends.contract.errors import UnknownBackendError
from attn_backends_contracts.hlo import compiled_instructions


def test_strict_backend_never_falls_back_and_gives_its_reasons(fake_registry):
    reg = fake_registry(
        make_backend("nowin", priority=9, window=False), make_backend("any", priority=1)
    )
    q, k, v = qkv()
    with pytest.raises(
        ab.UnsupportedError, match=r"backend='nowin' cannot serve .* feature 'window' not supported"
    ):
        reg.get(device="cpu", backend="nowin")(q, k, v, window=(2, 2))


def test_unknown_backend_name_lists_installed(fake_registry):
    reg = fake_registry(make_backend("one"), make_backend("two"))
    with pytest.raises(UnknownBackendError, match=r"backend='three'.*installed: one, two"):
        reg.get(device="cpu", backend="three")


def test_bad_device_and_fallback_arguments(fake_registry):
    reg = fake_registry(make_backend("one"))
    with pytest.raises(ValueError, match=r"device: 'gpuu' is not a platform name; did you mean"):
        reg.get(device="gpuu")
    with pytest.raises(ValueError, match=r"device: 'n p u' is not a platform name; a platform is"):
        reg.get(device="n p u")
    with pytest.raises(ValueError, match=r"device: expected None, a platform name .* got 3"):
        reg.get(device=3)
    with pytest.raises(ValueError, match=r"fallback: expected one of"):
        reg.get(fallback="loud")


def test_absent_platform_raises_eagerly_naming_visible_platforms(fake_registry):
    reg = fake_registry(make_backend("one"))
    att = reg.get(device="tpu")
    assert att.present is False
    q, k, v = qkv()
    with pytest.raises(
        ab.PlatformUnavailableError, match=r"JAX sees no tpu here \(visible: cpu\).*jax.export"
    ):
        att(q, k, v)


def test_absent_platform_selects_by_manifest_for_export(fake_registry):
    reg = fake_registry(
        make_backend("cpu_only", priority=9, platforms=("cpu",)), make_backend("everywhere")
    )
    att = reg.get(device="tpu")
    q, k, v = qkv()
    exp = att.explain(q, k, v, causal=True)
    assert exp.chosen == "everywhere" and exp.present is False and "unprobed" in str(exp)
    causal_attention = jax.jit(lambda q, k, v: att(q, k, v, causal=True))
    exported = jax.export.export(causal_attention, platforms=["tpu"])(q, k, v)
    assert exported.platforms == ("tpu",)
    assert "attn/everywhere" in exported.mlir_module()


def test_fallback_warns_once_per_signature(fake_registry):
    reg = fake_registry(
        make_backend("fast", priority=9, softcap=False), make_backend("slow", priority=1)
    )
    att = reg.get(device="cpu")
    q, k, v = qkv()
    with pytest.warns(
        ab.FallbackWarning,
        match=r"served by 'slow', passing over fast: feature 'softcap' not supported",
    ):
        att(q, k, v, softcap=5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        att(q, k, v, softcap=5.0)  # same signature: silent
        att(q, k, v)  # the preferred backend serves: nothing to say
    with pytest.warns(ab.FallbackWarning):
        att(q[:, :5], k, v, softcap=5.0)  # a new signature warns again


def test_fallback_error_and_silent(fake_registry):
    reg = fake_registry(
        make_backend("fast", priority=9, softcap=False), make_backend("slow", priority=1)
    )
    q, k, v = qkv()
    with pytest.raises(ab.UnsupportedError, match=r"passing over fast.*fallback='error'"):
        reg.get(device="cpu", fallback="error")(q, k, v, softcap=5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.get(device="cpu", fallback="silent")(q, k, v, softcap=5.0)


def test_no_backend_error_carries_every_reason(fake_registry):
    reg = fake_registry(make_backend("a", mask=False), make_backend("b", platforms=("tpu",)))
    q, k, v = qkv()
    with pytest.raises(ab.NoBackendError) as info:
        reg.get(device="cpu")(q, k, v, mask=jnp.ones((1, 1, 8, 8), bool))
    assert info.value.reasons == {
        "a": ["feature 'mask' not supported"],
        "b": ["platform 'cpu' not in ['tpu']"],
    }


def test_selection_runs_once_per_signature_at_trace_time(fake_registry):
    checks = []
    reg = fake_registry(make_backend("counted", check=lambda call: checks.append(call) or []),
                        probe="auto")
    att = reg.get(device="cpu")
    step = jax.jit(lambda q, k, v: att(q, k, v, causal=True))
    q, k, v = qkv()
    step(q, k, v)
    # Selection checks the call once; its probe checks its canonical probe call.
    assert len(checks) == 2
    for _ in range(2):
        step(q, k, v)
    att(q, k, v, causal=True)  # eager, same signature: cached selection
    assert len(checks) == 2
    step(q[:, :4], k, v)  # new shape: one more selection, and its own probe
    assert len(checks) == 4


def test_threads_tracing_one_signature_at_once_select_and_warn_once(fake_registry):
    checks = []

    def slow_refusal(call):
        checks.append(call)
        time.sleep(0.2)  # keep the first selection running while the others arrive
        return ["cannot today"]

    reg = fake_registry(make_backend("busy", priority=9, check=slow_refusal),
                        make_backend("spare", priority=1))
    att = reg.get(device="cpu")
    call = ab.bind(*qkv())[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=att.backend_for, args=(call,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(checks) == 1
    assert [w.category for w in caught] == [ab.FallbackWarning]


def test_selection_cache_is_bounded(fake_registry, monkeypatch):
    monkeypatch.setattr(_attention, "SELECTION_CACHE_SIZE", 4)
    reg = fake_registry(make_backend("zeros", attend=lambda call, q, k, v, ops: jnp.zeros_like(q)))
    att = reg.get(device="cpu")
    q, k, v = qkv()
    for t in range(1, 11):
        att(q[:, :t], k, v)
    assert len(att._selections) == 4


def test_jitted_program_is_the_backends_own_plus_its_named_scope(fake_registry):
    backend = make_backend("dense")
    att = fake_registry(backend).get(device="cpu")
    q, k, v = qkv()
    kwargs = dict(causal=True, softcap=30.0)
    via_registry = jax.jit(lambda q, k, v: att(q, k, v, **kwargs)).lower(q, k, v)
    call, ops = ab.bind(q, k, v, **kwargs)
    direct = jax.jit(lambda q, k, v: backend.attend(call, q, k, v, ops)).lower(q, k, v)
    # The platform dispatch (jax.lax.platform_dependent) is folded away, by JAX
    # while lowering for one platform (jax >= 0.12.1) or by XLA (a case on a
    # constant platform index, before): the programs compiled are the same,
    # instruction for instruction.
    assert compiled_instructions(via_registry.compile()) == compiled_instructions(direct.compile())
    if jax_api.release() < (0, 12, 1):
        assert "stablehlo.case" in via_registry.as_text()
    assert "attn/dense" in via_registry.as_text(debug_info=True)
    assert "attn/dense" not in direct.as_text(debug_info=True)


def test_backend_options_reach_attend(fake_registry):
    seen = {}

    class Opts(ab.Backend):
        name, version = "opts", "1"
        capabilities = ab.Capabilities(platforms=frozenset({"cpu"}), gqa=True, differentiable=True)

        def attend(self, call, q, k, v, operands, options=None):
            seen["options"] = options
            return jnp.zeros((call.batch, call.q_len, call.q_heads, call.v_head_dim), q.dtype)

    reg = fake_registry(Opts())
    q, k, v = qkv()
    reg.get(device="cpu", backend_options={"opts": {"block": 64}})(q, k, v)
    assert seen["options"] == {"block": 64}


def test_gradient_a_backend_lacks_fails_loudly(fake_registry):
    q, k, v = qkv()
    frozen = fake_registry(make_backend("frozen", differentiable=False)).get(device="cpu")
    frozen(q, k, v)  # forward is fine
    with pytest.raises(ab.UnsupportedError, match=r"backend 'frozen' is not differentiable"):
        jax.grad(lambda q: frozen(q, k, v).sum())(q)

    nobiasgrad = fake_registry(make_backend("nbg", bias_grad=False)).get(device="cpu")
    bias = jnp.zeros((1, 1, 8, 8))
    dq = jax.grad(lambda q: nobiasgrad(q, k, v, bias=bias).sum())(q)
    assert np.isfinite(np.asarray(dq)).all()
    with pytest.raises(ab.UnsupportedError, match=r"backend 'nbg' has no gradient w.r.t. bias"):
        jax.grad(lambda b: nobiasgrad(q, k, v, bias=b).sum())(bias)


@pytest.mark.parametrize("b,tq,tk", [(0, 8, 8), (2, 0, 8), (2, 8, 0)])
def test_empty_calls_give_zeros_without_running_a_kernel(fake_registry, b, tq, tk):
    def explode(*args):
        raise AssertionError("kernel must not run for an empty call")

    att = fake_registry(make_backend("boom", attend=explode)).get(device="cpu")
    q, k, v = qkv(b=b, tq=tq, tk=tk)
    out, lse = att(q, k, v, causal=True, return_lse=True)
    assert out.shape == (b, tq, 4, 8) and lse.shape == (b, 4, tq)
    assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all()
    dq = jax.grad(lambda q: att(q, k, v).sum())(q)
    assert dq.shape == q.shape and not np.asarray(dq).any()


def test_explain_is_structured_and_printable(fake_registry):
    reg = fake_registry(
        make_backend("fast", priority=9, window=False), make_backend("slow", priority=1)
    )
    q, k, v = qkv()
    exp = reg.explain(q, k, v, device="cpu", window=(1, 1))
    assert exp.chosen == "slow"
    data = exp.as_dict()
    assert data["verdicts"][0]["backend"] == "fast" and data["verdicts"][0]["accepted"] is False
    assert data["verdicts"][0]["reasons"] == ["feature 'window' not supported"]
    text = str(exp)
    assert "fast" in text and "rejected" in text and "CHOSEN" in text


def test_attention_made_before_a_reload_sees_the_new_backends(fake_registry):
    from _support import Plugin

    reg = fake_registry(make_backend("old", priority=1))
    att = reg.get(device="cpu")
    q, k, v = qkv()
    assert att.backend_for(ab.bind(q, k, v)[0]).name == "old"
    reg.register(Plugin(make_backend("new", priority=9)))
    assert att.backend_for(ab.bind(q, k, v)[0]).name == "new"


def test_prefer_takes_a_name_and_warns_about_names_not_installed(fake_registry):
    reg = fake_registry(make_backend("a", priority=9), make_backend("b", priority=1))
    q, k, v = qkv()
    assert reg.get(device="cpu", prefer="b").explain(q, k, v).chosen == "b"
    with pytest.warns(
        ab.AttnBackendsWarning, match=r"'refrence' not installed \(installed: a, b\); ignored"
    ):
        reg.get(device="cpu", prefer=["refrence", "b"])


def test_fallback_warning_points_at_the_callers_line(fake_registry):
    reg = fake_registry(
        make_backend("fast", priority=9, softcap=False), make_backend("slow", priority=1)
    )
    q, k, v = qkv()
    with pytest.warns(ab.FallbackWarning) as record:
        reg.get(device="cpu")(q, k, v, softcap=5.0)
    assert record[0].filename == __file__


def test_backend_options_for_a_backend_not_installed_warn(fake_registry):
    reg = fake_registry(make_backend("a"), make_backend("b"))
    with pytest.warns(ab.AttnBackendsWarning,
                      match=r"backend_options: 'xla_nativ' not installed \(installed: a, b\); "
                            r"ignored"):
        reg.get(device="cpu", backend_options={"xla_nativ": object(), "a": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.get(device="cpu", backend_options={"a": None})


def test_lengths_past_the_sequence_are_clipped_before_any_backend_sees_them(fake_registry):
    seen = []

    def spy(call, q, k, v, ops):
        seen.append((np.asarray(ops.q_lengths).tolist(), np.asarray(ops.kv_lengths).tolist()))
        return dense(call, q, k, v, ops)

    att = fake_registry(make_backend("spy", attend=spy)).get(device="cpu")
    q, k, v = qkv(b=3, tq=5, tk=7)
    outside = att(q, k, v, q_lengths=jnp.array([9, -1, 4]), kv_lengths=jnp.array([12, -3, 6]))
    inside = att(q, k, v, q_lengths=jnp.array([5, 0, 4]), kv_lengths=jnp.array([7, 0, 6]))
    assert seen == [([5, 0, 4], [7, 0, 6])] * 2
    want, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                               q_lengths=np.array([9, -1, 4]), kv_lengths=np.array([12, -3, 6]))
    np.testing.assert_array_equal(np.asarray(outside), np.asarray(inside))
    np.testing.assert_allclose(np.asarray(outside), want, atol=1e-5)
