"""Probes: quarantine of wrong, raising and slow backends; the disk cache; no leaks."""

from __future__ import annotations

import gc
import json
import time
import warnings

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import Plugin, dense, make_backend, make_dist, qkv
from attn_backends.choose import attention as _attention
from attn_backends.probe import certificates as _certificates
from attn_backends.probe import prober as _probe
from attn_backends.probe.run import run_probe

# A backend that claims causal but ignores it: the classic silent bug.
IGNORES_CAUSAL = (
    "def attend(self, call, q, k, v, operands, options=None):\n"
    "        import dataclasses\n"
    "        from attn_backend_reference._dense import dense_attention\n"
    "        return dense_attention(dataclasses.replace(call, causal=False), q, k, v, operands)\n"
)


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    monkeypatch.syspath_prepend(str(path))
    path.mkdir()
    return path


def _ignoring_causal_dist(site):
    module = make_dist(site, "attn-backend-liar", "liar")
    path = site / f"{module}.py"
    src = path.read_text()
    start = src.index("    def attend(")
    end = src.index("@hookimpl")
    path.write_text(src[:start] + "    " + IGNORES_CAUSAL + "\n" + src[end:])


class CompileCounter:
    """Counts XLA backend compilations while active."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()


def test_wrong_backend_installed_as_a_distribution_is_quarantined(site):
    _ignoring_causal_dist(site)
    reg = ab.Registry(only=["reference", "liar"])
    att = reg.get(device="cpu")
    q, k, v = qkv(hq=2, hkv=2)
    step = jax.jit(lambda q, k, v: att(q, k, v, causal=True))
    with pytest.warns(ab.FallbackWarning) as record:
        out = step(q, k, v)
        step(q, k, v)
    assert len(record) == 1
    assert (
        "served by 'reference', passing over liar: probe: out differs from the float64 oracle"
        in str(record[0].message)
    )
    want = reg.get(device="cpu", backend="reference")(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Without causal it is right, so the same backend serves that key.
    assert att.explain(q, k, v).chosen == "liar"
    verdict = next(v for v in att.explain(q, k, v, causal=True).verdicts if v.backend == "liar")
    assert verdict.probed is True and not verdict.accepted
    with pytest.raises(
        ab.UnsupportedError, match=r"backend='liar' cannot serve .*probe: out differs"
    ):
        reg.get(device="cpu", backend="liar")(q, k, v, causal=True)


def test_cached_verdict_compiles_nothing_and_survives_a_new_process(site, isolated_cache):
    _ignoring_causal_dist(site)
    q, k, v = qkv(hq=2, hkv=2)
    first = ab.Registry(only=["reference", "liar"]).get(device="cpu")
    before = COMPILES.count
    assert first.explain(q, k, v, causal=True).chosen == "reference"
    assert COMPILES.count > before  # the probes compiled and ran
    # liar's verdict (failed) and reference's (passed: it is probed too, as the
    # first backend left after liar).
    assert len(list((isolated_cache / "probes").glob("*.json"))) == 2
    fresh = ab.Registry(only=["reference", "liar"]).get(device="cpu")  # new memory cache
    before = COMPILES.count
    assert fresh.explain(q, k, v, causal=True).chosen == "reference"
    assert COMPILES.count == before


def _prober_registry(runner, *backends, **kwargs):
    """A registry whose prober runs ``runner`` for the fakes and passes "reference"."""
    reference = make_backend("reference", priority=0)

    def run(backend, call, platform, options):
        return [] if backend.name == "reference" else runner(backend, call, platform, options)

    reg = ab.Registry(plugins=[Plugin(reference, *backends)], autoload=False, probe=None)
    reg.probe = _probe.Prober(runner=run, **kwargs)
    return reg


def test_probe_that_raises_quarantines_with_the_reason():
    def runner(backend, call, platform, options):
        raise RuntimeError("Mosaic lowering failed\nlong details")

    reg = _prober_registry(runner, make_backend("fragile", priority=9))
    q, k, v = qkv()
    exp = reg.get(device="cpu").explain(q, k, v)
    assert exp.chosen == "reference"
    assert exp.verdicts[0].reasons == ("probe raised RuntimeError: Mosaic lowering failed",)


def test_probe_over_its_time_budget_quarantines():
    def runner(backend, call, platform, options):
        time.sleep(2.0)
        return []

    reg = _prober_registry(runner, make_backend("slowpoke", priority=9), budget_s=0.2)
    q, k, v = qkv()
    start = time.perf_counter()
    exp = reg.get(device="cpu").explain(q, k, v)
    assert time.perf_counter() - start < 1.5  # the caller does not wait for the probe
    assert exp.chosen == "reference"
    assert exp.verdicts[0].reasons == (
        "probe did not finish within the 0.2 s budget (ATTN_BACKENDS_PROBE_BUDGET_S)",
    )


def test_timeouts_stay_in_memory_and_the_probe_thread_never_blocks_exit(isolated_cache):
    import threading

    release = threading.Event()
    reg = _prober_registry(lambda *a: release.wait(30) and [], make_backend("slowpoke", priority=9),
                           budget_s=0.1)
    q, k, v = qkv()
    assert reg.get(device="cpu").explain(q, k, v).chosen == "reference"
    on_disk = [json.loads(p.read_text())["key"]["backend"]
               for p in (isolated_cache / "probes").glob("*.json")]
    assert on_disk == ["reference"]  # slowpoke's timeout stayed in memory
    probe_threads = [t for t in threading.enumerate() if t.name == "attn-probe-slowpoke"]
    assert probe_threads and all(t.daemon for t in probe_threads)
    release.set()


def test_matching_certificate_counts_as_a_passed_probe():
    ran = []
    reg = _prober_registry(
        lambda *a: ran.append(a) or ["wrong"], make_backend("certified", priority=9)
    )
    key = _certificates.environment_key(reg.backend("certified"), "cpu")
    quick = {**key, "passed": True, "mode": "quick", "only_families": None}
    assert _certificates.store(quick) is not None
    q, k, v = qkv()
    assert reg.get(device="cpu").explain(q, k, v).chosen == "reference"  # a quick run is not enough
    assert len(ran) == 1
    full = {**quick, "mode": "full"}
    assert _certificates.store(full) is not None
    reg = _prober_registry(
        lambda *a: ran.append(a) or ["wrong"], make_backend("certified", priority=9)
    )
    assert reg.get(device="cpu").explain(q, k, v).chosen == "certified"
    assert len(ran) == 1


def test_unwritable_cache_keeps_verdicts_in_memory_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(blocker / "cache"))
    runs = []
    reg = _prober_registry(lambda *a: runs.append(a) or [], make_backend("fine", priority=9))
    att = reg.get(device="cpu")
    q, k, v = qkv()
    with pytest.warns(ab.AttnBackendsWarning, match=r"probe cache directory .* is not writable"):
        assert att.explain(q, k, v).chosen == "fine"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert att.explain(q, k, v, causal=True).chosen == "fine"  # new key, no second warning
        assert att.explain(q, k, v).chosen == "fine"  # memory hit
    assert len(runs) == 2


def test_corrupt_cache_entry_is_reprobed_with_one_warning(isolated_cache):
    runs = []
    reg = _prober_registry(lambda *a: runs.append(a) or [], make_backend("fine", priority=9))
    q, k, v = qkv()
    reg.get(device="cpu").explain(q, k, v)
    (entry,) = (isolated_cache / "probes").glob("*.json")
    entry.write_text("{not json")
    reg2 = _prober_registry(lambda *a: runs.append(a) or [], make_backend("fine", priority=9))
    with pytest.warns(ab.AttnBackendsWarning, match=r"probe cache entry .* is unreadable"):
        assert reg2.get(device="cpu").explain(q, k, v).chosen == "fine"
    assert len(runs) == 2
    assert json.loads(entry.read_text())["passed"] is True  # rewritten


def test_thousand_calls_keep_caches_bounded_and_no_arrays_alive(monkeypatch):
    monkeypatch.setattr(_attention, "SELECTION_CACHE_SIZE", 16)
    monkeypatch.setattr(_probe, "MEMORY_CACHE_SIZE", 8)

    def zeros(call, q, k, v, ops):
        return jnp.zeros((call.batch, call.q_len, call.q_heads, call.v_head_dim), q.dtype)

    reg = _prober_registry(lambda *a: [], make_backend("fine", priority=9, attend=zeros))
    att = reg.get(device="cpu")
    # Inputs built once: 40 lengths x 2 dtypes x causal/softcap variants give
    # far more signatures than either cache holds.
    inputs = {
        (t, dtype): tuple(x.astype(dtype) for x in qkv(tq=t, tk=40))
        for t in range(1, 41)
        for dtype in ("float32", "bfloat16")
    }

    def one_call(i):
        q, k, v = inputs[(1 + i % 40, ("float32", "bfloat16")[i % 2])]
        kw = {"causal": i % 3 == 0, "softcap": 10.0 if i % 5 == 0 else None}
        att(q, k, v, **kw).block_until_ready()

    for i in range(120):  # every signature once, so op caches are warm
        one_call(i)
    gc.collect()
    live_before = len(jax.live_arrays())
    for i in range(1000):
        one_call(i)
    gc.collect()
    assert len(jax.live_arrays()) == live_before
    assert len(att._selections) <= 16
    assert reg.probe.memory_size <= 8


def test_probe_runs_in_the_callers_context():
    import contextvars

    switch = contextvars.ContextVar("switch", default=False)

    def runner(backend, call, platform, options):
        return [] if switch.get() else ["the caller's context was not visible"]

    reg = _prober_registry(runner, make_backend("contextual", priority=9))
    q, k, v = qkv()
    token = switch.set(True)  # like flash_pallas' interpret_mode()
    try:
        assert reg.get(device="cpu").explain(q, k, v).chosen == "contextual"
    finally:
        switch.reset(token)


def test_real_probe_compares_forward_only_for_a_non_differentiable_backend():
    from attn_backend_reference._dense import dense_attention

    @jax.custom_jvp
    def no_derivative(x):
        return x

    @no_derivative.defjvp
    def _(primals, tangents):
        raise AssertionError("the probe differentiated a backend that declares no gradients")

    def forward_only(call, q, k, v, operands):
        return no_derivative(dense_attention(call, q, k, v, operands))

    frozen = make_backend("frozen", priority=9, differentiable=False, attend=forward_only)
    verdict = run_probe(frozen, ab.bind(*qkv(), causal=True)[0], "cpu")
    assert verdict == []


def test_probe_compares_lse_when_the_call_returns_it():
    from attn_backend_reference._dense import dense_attention

    def zero_lse(call, q, k, v, operands):
        result = dense_attention(call, q, k, v, operands)
        return (result[0], jnp.zeros_like(result[1])) if call.return_lse else result

    liar = make_backend("zero_lse", attend=zero_lse)
    q, k, v = qkv()
    # kv_lengths of 0 give rows with lse -inf in both: those must compare equal.
    lengths = np.array([0, 5], np.int32)
    honest = make_backend("honest")
    assert run_probe(
        honest, ab.bind(q, k, v, kv_lengths=lengths, return_lse=True)[0], "cpu"
    ) == []
    call = ab.bind(q, k, v, return_lse=True)[0]
    reasons = run_probe(liar, call, "cpu")
    # Its lse is wrong, and so are dq and dk: the lse cotangent never reaches them.
    assert [r.split(" differs")[0] for r in reasons] == ["probe: lse", "probe: dq", "probe: dk"]
    # Without return_lse its out is all that is used, and that is right.
    assert run_probe(liar, ab.bind(q, k, v)[0], "cpu") == []


def test_probe_retries_longer_shapes_when_check_rejects_the_short_one():

    picky = make_backend("picky", check=lambda call: [] if call.q_len >= 128 else ["Tq < 128"])
    q, k, v = qkv(tq=300, tk=300)
    assert run_probe(picky, ab.bind(q, k, v)[0], "cpu") == []
    never = make_backend("never", check=lambda call: [] if call.q_len >= 1000 else ["Tq < 1000"])
    assert run_probe(never, ab.bind(q, k, v)[0], "cpu") is None


def test_unprobeable_and_lower_ranked_backends_are_not_reported_as_probed():
    reg = _prober_registry(lambda *a: None, make_backend("unprobeable", priority=9))
    exp = reg.get(device="cpu").explain(*qkv())
    # "unprobeable" is accepted without a comparison; "reference", ranked below
    # the chosen one, is not probed at all.
    assert {v.backend: v.probed for v in exp.verdicts} == {"unprobeable": False, "reference": None}


def _split_forward(primal_factor, vjp_factor):
    """A backend whose plain forward and whose forward under vjp are different code
    (a custom_vjp), scaled by the given factors."""
    def attend(call, q, k, v, ops):
        @jax.custom_vjp
        def f(q, k, v):
            return dense(call, q, k, v, ops) * primal_factor

        def fwd(q, k, v):
            out, pull = jax.vjp(lambda *a: dense(call, *a, ops), q, k, v)
            return out * vjp_factor, pull

        f.defvjp(fwd, lambda pull, g: pull(g))
        return f(q, k, v)

    return make_backend("split", attend=attend)


def test_probe_checks_the_inference_program_and_the_training_program_apart():
    call = ab.bind(*qkv())[0]
    assert run_probe(_split_forward(1.0, 1.0), call, "cpu") == []
    wrong_inference = run_probe(_split_forward(1.5, 1.0), call, "cpu")
    assert [r.split(" differs")[0] for r in wrong_inference] == ["probe: out"]
    wrong_training = run_probe(_split_forward(1.0, 1.5), call, "cpu")
    assert [r.split(" differs")[0] for r in wrong_training] == ["probe, forward under jax.vjp: out"]


def test_a_verdict_whose_key_holds_a_tuple_is_read_back_from_disk(isolated_cache):
    # A window is a tuple in the key and a list on disk: the two must still match.
    runs = []
    q, k, v = qkv()
    for _ in range(2):
        reg = _prober_registry(lambda *a: runs.append(a) or [], make_backend("fine", priority=9))
        assert reg.get(device="cpu").explain(q, k, v, window=(3, 0)).chosen == "fine"
    assert len(runs) == 1
