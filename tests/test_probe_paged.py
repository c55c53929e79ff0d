"""Paged probes (docs/DESIGN.md, "Probes, verdicts and certificates"): a wrong paged
backend is quarantined at ``get_paged`` with one FallbackWarning naming it and the
mismatch; verdicts are cached in memory and on disk, across registries and
processes; a certificate counts as a passed paged probe; explain shows the verdict."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import attn_backends as ab
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import make_paged_backend, paged_case
from _support import Plugin
from attn_backends.probe import certificates as _certificates
from attn_backends.probe import prober as _probe
from test_probe import COMPILES

CALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32",
            window=(3, None))


def _liar(name: str = "liar", priority: int = 9) -> ab.Backend:
    """A paged fake that claims window but ignores it: the classic silent bug."""
    liar = make_paged_backend(name, priority=priority)
    honest = liar.attend_paged

    def attend_paged(call, q, cache, batch, options=None):
        return honest(dataclasses.replace(call, window=None), q, cache, batch, options)

    liar.attend_paged = attend_paged
    return liar


def _registry(*backends: ab.Backend, **kwargs) -> ab.Registry:
    return ab.Registry(plugins=[Plugin(*backends)], autoload=False, **kwargs)


def test_a_wrong_paged_backend_is_quarantined_and_passed_over_loudly():
    reg = _registry(_liar(), make_paged_backend("honest", priority=1))
    with pytest.warns(ab.FallbackWarning) as record:
        paged = reg.get_paged(**CALL)
    assert paged.backend.name == "honest"
    (warning,) = record
    assert "served by 'honest', passing over liar: probe: out differs from the float64 " \
        "oracle" in str(warning.message)
    verdicts = {v.backend: v for v in paged.explain().verdicts}
    assert verdicts["liar"].probed is True and not verdicts["liar"].accepted
    assert verdicts["honest"].probed is True and verdicts["honest"].accepted
    assert "liar" in str(paged.explain()) and "probe: out differs" in str(paged.explain())
    # The honest one serves the right answer on a real batch.
    case = paged_case([(3, 7), (1, 10)], page_size=4)
    cache = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    out = np.asarray(paged(jnp.asarray(case.q), cache, case.batch()))
    np.testing.assert_allclose(out, case.expected(scale=paged.call.scale, window=(3, None)),
                               atol=2e-6)
    # Without a window the liar is right, so it serves that call.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.get_paged(**{**CALL, "window": None}).backend.name == "liar"
    with pytest.raises(ab.UnsupportedError, match=r"backend='liar' cannot serve .*probe: out "
                                                   "differs from the float64 oracle"):
        reg.get_paged(**CALL, backend="liar")
    explained = reg.explain_paged(**CALL)
    assert explained.chosen == "honest"
    assert any("probe: out differs" in r for r in explained.verdicts[0].reasons)


def test_paged_verdicts_are_cached_in_memory_and_on_disk(isolated_cache):
    runs = []

    def runner(backend, call, platform, options):
        runs.append(call)
        return ["probe: out differs from the float64 oracle (fake)"] \
            if backend.name == "liar" else []

    def registry():
        reg = _registry(make_paged_backend("liar", priority=9),
                        make_paged_backend("honest", priority=1), probe=None)
        reg.probe = _probe.Prober(paged_runner=runner)
        return reg

    reg = registry()
    with pytest.warns(ab.FallbackWarning):
        assert reg.get_paged(**CALL).backend.name == "honest"
    with pytest.warns(ab.FallbackWarning):  # a memory hit: no probe runs again
        assert reg.get_paged(**CALL).backend.name == "honest"
    assert len(runs) == 2
    records = [json.loads(p.read_text()) for p in (isolated_cache / "probes").glob("*.json")]
    by_backend = {r["key"]["backend"]: r for r in records}
    assert set(by_backend) == {"liar", "honest"}
    assert by_backend["liar"]["passed"] is False
    assert by_backend["liar"]["key"]["paged_call"]["window"] == [3, None]
    assert by_backend["liar"]["probe_call"].startswith("paged q[T,4,8]")
    assert _probe.quarantined("liar")[0]["reasons"] == [
        "probe: out differs from the float64 oracle (fake)"]
    with pytest.warns(ab.FallbackWarning):  # a new registry reads the disk
        assert registry().get_paged(**CALL).backend.name == "honest"
    assert len(runs) == 2
    # Another call is another key (and its options another again).
    assert registry().get_paged(**{**CALL, "window": (5, None)}, fallback="silent")
    assert len(runs) == 4


def test_a_certificate_counts_as_a_passed_paged_probe():
    ran = []

    def runner(backend, call, platform, options):
        ran.append(call)
        return ["wrong"]

    def registry():
        reg = _registry(make_paged_backend("certified", priority=9),
                        make_paged_backend("other", priority=1), probe=None)
        reg.probe = _probe.Prober(paged_runner=lambda b, *a: [] if b.name == "other"
                                  else runner(b, *a))
        return reg

    key = _certificates.environment_key(registry().backend("certified"), "cpu")
    assert _certificates.store({**key, "passed": True, "mode": "quick",
                                "only_families": None}) is not None
    assert registry().get_paged(**CALL, fallback="silent").backend.name == "other"
    assert len(ran) == 1  # a quick run is not enough
    assert _certificates.store({**key, "passed": True, "mode": "full",
                                "only_families": None}) is not None
    assert registry().get_paged(**CALL).backend.name == "certified"
    assert len(ran) == 1


def test_a_probe_without_a_paged_side_judges_dense_calls_only():
    reg = _registry(_liar(), probe=lambda backend, call, platform, options: ["never asked"])
    paged = reg.get_paged(**CALL)
    assert paged.backend.name == "liar" and paged.explain().verdicts[0].probed is None


# The child reads the verdict its parent left on disk: no probe runs, nothing compiles.
_CHILD = """
import json, jax, attn_backends as ab
from attn_backends.contract.paged_bind import bind_paged
from attn_backends.probe.prober import Prober
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)
backend = ab.Registry(probe=None, only=["reference"]).backend("reference")
verdict = Prober().verdict(backend, bind_paged(**json.loads(%r)), "cpu")
print("VERDICT", verdict.source, verdict.passed, len(compiles))
"""


def test_a_real_paged_verdict_survives_a_new_process(isolated_cache):
    pytest.importorskip("attn_backend_reference")
    reg = ab.Registry(only=["reference"])
    before = COMPILES.count
    paged = reg.get_paged(**CALL)
    assert paged.explain().verdicts[0].probed is True
    assert COMPILES.count > before  # the probe compiled and ran
    (record,) = [json.loads(p.read_text()) for p in (isolated_cache / "probes").glob("*.json")]
    assert record["passed"] is True and record["key"]["backend"] == "reference"
    before = COMPILES.count
    assert ab.Registry(only=["reference"]).get_paged(**CALL).explain().verdicts[0].probed
    assert COMPILES.count == before
    env = dict(os.environ, ATTN_BACKENDS_CACHE_DIR=str(isolated_cache))
    proc = subprocess.run([sys.executable, "-c", _CHILD % json.dumps(CALL)], env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VERDICT")), None)
    assert line == "VERDICT disk True 0", proc.stdout + proc.stderr[-2000:]
