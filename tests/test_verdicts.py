"""Verdicts sound both ways: no correct backend quarantined, no broken one served.

Each test is one of the faults found when the product was tried as a new
user would (probes reading rounding noise as errors, certificates outliving
the code that earned them, probes off without the reference distribution,
options ignored, misspelt hooks), kept as a regression test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import Plugin, make_backend, make_dist, qkv
from attn_backends.probe import certificates as _certificates
from attn_backends.probe import oracle as oracle
from attn_backends.probe import prober as _probe
from attn_backends.probe import tolerances as tolerances
from attn_backends.probe import verdicts as _verdicts
from attn_backends_cli.main import main

S = jax.ShapeDtypeStruct
f32 = jnp.float32


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def _real(*names: str) -> ab.Registry:
    return ab.Registry(only=list(names))


# The three calls that quarantined xla_native on a correct answer: rows that
# see one key, where dq is zero up to rounding.
ONE_KEY_CALLS = {
    "decode-first-step-lse": (S((1, 64, 4, 64), f32), S((1, 1, 4, 64), f32),
                              dict(return_lse=True)),
    "one-key-mask": (S((2, 100, 4, 16), f32), S((2, 1, 4, 16), f32),
                     dict(mask=S((2, 1, 100, 1), jnp.bool_))),
    "segments-and-lengths": (S((1, 5, 4, 64), f32), S((1, 5, 4, 64), f32),
                             dict(segment_ids=(S((1, 5), jnp.int32), S((1, 5), jnp.int32)),
                                  kv_lengths=S((1,), jnp.int32))),
}


@pytest.mark.parametrize("name", sorted(ONE_KEY_CALLS))
def test_rows_that_see_one_key_do_not_quarantine_a_correct_backend(name):
    q, kv, kwargs = ONE_KEY_CALLS[name]
    exp = _real("xla_native", "reference").get(device="cpu").explain(q, kv, kv, **kwargs)
    verdict = exp.verdicts[0]
    assert (verdict.backend, verdict.probed, verdict.reasons) == ("xla_native", True, ())
    assert exp.chosen == "xla_native"


def test_a_verdict_covers_its_shape_class_and_no_other(isolated_cache):
    att = _real("xla_native", "reference").get(device="cpu")
    q = S((2, 300, 4, 32), f32)
    for tk in (1, 200, 500):  # Tk of 1 is a class of its own; 200 and 500 share "long"
        kv = S((2, tk, 2, 32), f32)
        assert att.explain(q, kv, kv, causal=True).chosen == "xla_native"
    calls = sorted(r["probe_call"] for r in _verdicts.records())
    assert calls == [
        "q[2,45,4,32] kv[2,77,2,32/32] float32 gqa causal",  # Tq < Tk, both long
        "q[2,77,4,32] kv[2,1,2,32/32] float32 gqa causal",
        "q[2,77,4,32] kv[2,45,2,32/32] float32 gqa causal",  # Tq > Tk: empty causal rows
    ]


CAUSAL_TOP_LEFT = (
    '''
    def attend(self, call, q, k, v, operands, options=None):
        import jax.numpy as jnp
        from attn_backend_reference._dense import dense_attention
        if call.causal:  # the bug: causal aligned top-left, wrong whenever Tq != Tk
            tri = jnp.tril(jnp.ones((call.q_len, call.kv_len), bool))[None, None]
            mask = tri if operands.mask is None else operands.mask & tri
'''
    "            call = dataclasses.replace("
    "call, causal=False, mask_shape=(1, 1, call.q_len, call.kv_len))\n"
    '''            operands = operands._replace(mask=mask)
        return dense_attention(call, q, k, v, operands)
'''
)


def _rebuild_with_top_left_causal(site, module: str) -> None:
    path = site / f"{module}.py"
    src = path.read_text()
    start, end = src.index("    def attend("), src.index("@hookimpl")
    path.write_text(
        "import dataclasses\n" + src[:start] + CAUSAL_TOP_LEFT.lstrip("\n") + "\n" + src[end:]
    )


def _run(site, isolated_cache, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "ATTN_BACKENDS_CACHE_DIR": str(isolated_cache),
           "ATTN_BACKENDS_ONLY": "reference,thirdparty"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def test_rebuilding_a_certified_backend_voids_its_certificate_and_the_probe_catches_it(
    site, isolated_cache
):
    module = make_dist(site, "attn-backend-thirdparty", "thirdparty", version="1.0")
    backend = _real("thirdparty").backend("thirdparty")
    # What `attn-backends check thirdparty` stores after a full passing run.
    cert = {**_certificates.environment_key(backend, "cpu"), "passed": True, "mode": "full",
            "only_families": None, "cases": {"run": 3, "passed": 3}}
    assert _certificates.store(cert) is not None
    assert _certificates.status(backend, "cpu").counts

    _rebuild_with_top_left_causal(site, module)  # same name, same version, new code
    listing = _run(site, isolated_cache, "from attn_backends_cli.main import main; main(['list'])")
    assert listing.returncode == 0, listing.stderr
    line = next(line for line in listing.stdout.splitlines() if line.startswith("thirdparty"))
    assert "VOID: the backend's code changed since it was certified" in line

    served = _run(site, isolated_cache, """
import warnings, json, numpy as np, jax.numpy as jnp
import attn_backends as ab
from attn_backends import oracle
rng = np.random.default_rng(1)
q = jnp.asarray(rng.normal(size=(1, 8, 2, 16)), jnp.float32)
k = jnp.asarray(rng.normal(size=(1, 24, 2, 16)), jnp.float32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    att = ab.registry.get(device="cpu", prefer=["thirdparty"])
    out = att(q, k, k, causal=True)
    chosen = att.explain(q, k, k, causal=True).chosen
want, _ = oracle.attention(q, k, k, causal=True)
print(json.dumps({"chosen": chosen, "error": float(np.max(np.abs(np.asarray(out) - want))),
                  "warnings": [str(w.message) for w in caught]}))
""")
    assert served.returncode == 0, served.stderr
    result = json.loads(served.stdout.strip().splitlines()[-1])
    assert result["chosen"] == "reference"
    assert result["error"] < 1e-5
    assert any("passing over thirdparty: probe: out differs" in w for w in result["warnings"])


def test_probes_need_no_reference_distribution(site):
    module = make_dist(site, "attn-backend-thirdparty", "thirdparty", version="1.0")
    _rebuild_with_top_left_causal(site, module)
    reg = _real("xla_native", "thirdparty")  # no reference installed
    assert "reference" not in reg.backends
    q, k, v = qkv(tq=8, tk=24, hq=2, hkv=2)
    with pytest.warns(ab.FallbackWarning, match="passing over thirdparty: probe: out differs"):
        out = reg.get(device="cpu", prefer=["thirdparty"])(q, k, v, causal=True)
    want, _ = oracle.attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_the_probe_runs_under_the_callers_backend_options():
    def attend(self, call, q, k, v, ops, options=None):
        from attn_backend_reference._dense import dense_attention

        out = dense_attention(call, q, k, v, ops)
        return out * 2 if options == "broken-tiles" else out

    backend = make_backend("optioned", priority=9)
    type(backend).attend = attend  # right by default, wrong under the caller's options
    reg = ab.Registry(plugins=[Plugin(backend)], only=["optioned", "reference"])
    q, k, v = qkv()
    assert reg.get(device="cpu").explain(q, k, v).chosen == "optioned"
    broken = reg.get(device="cpu", backend_options={"optioned": "broken-tiles"})
    exp = broken.explain(q, k, v)
    assert exp.chosen == "reference"
    assert exp.verdicts[0].reasons[0].startswith("probe: out differs from the float64 oracle")


def test_the_probe_and_the_suite_read_one_tolerance_table(monkeypatch):
    from attn_backends_contracts import tolerances as suite_tolerances

    assert suite_tolerances.tolerance is tolerances.tolerance
    assert suite_tolerances.TOLERANCES is tolerances.TOLERANCES
    reg = _real("xla_native", "reference")
    q, k, v = qkv(tq=40, tk=40)
    assert reg.get(device="cpu").explain(q, k, v).chosen == "xla_native"
    # With every tolerance at zero, float32 rounding fails the probe: it reads the table.
    strict = tolerances.Tolerance(1e-30, 0.0, "test: nothing allowed")
    monkeypatch.setattr(tolerances, "tolerance", lambda *a, **kw: strict)
    from attn_backends.probe import run as _probe_run

    monkeypatch.setattr(_probe_run, "tolerance", lambda *a, **kw: strict)
    exp = _real("xla_native", "reference").get(device="cpu").explain(q, k, v, causal=True)
    assert exp.chosen is None
    assert "allowed 1e-30 + 0 x" in exp.verdicts[0].reasons[0]


def test_quarantines_are_listed_with_their_numbers_and_cleared_by_name(
    site, isolated_cache, capsys, monkeypatch
):
    module = make_dist(site, "attn-backend-thirdparty", "thirdparty", version="1.0")
    _rebuild_with_top_left_causal(site, module)
    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "thirdparty,reference")
    try:
        ab.registry.reload()
        q, k, v = qkv(tq=8, tk=24, hq=2, hkv=2)
        assert ab.registry.get(device="cpu", fallback="silent").explain(
            q, k, v, causal=True).chosen == "reference"
        assert main(["probe", "--quarantined"]) == 1
        shown = capsys.readouterr().out
        assert "1 quarantined verdict(s)" in shown
        assert "probe call: q[2,8,2,8] kv[2,77,2,8/8] float32 causal" in shown
        assert "x its tolerance at" in shown  # the numbers, not just a verdict
        assert main(["probe", "--clear", "reference"]) == 0
        assert len(_probe.quarantined("thirdparty")) == 1  # another backend's clear keeps it
        assert main(["probe", "--clear", "thirdparty"]) == 0
        assert _probe.quarantined() == []
    finally:
        monkeypatch.delenv("ATTN_BACKENDS_ONLY")
        ab.registry.reload()


def test_a_misspelt_hook_is_a_load_problem_naming_the_distribution(site):
    module = make_dist(site, "attn-backend-typo", "typo")
    path = site / f"{module}.py"
    path.write_text(path.read_text().replace("def attn_backends_register():",
                                             "def attn_backend_register():"))
    with pytest.warns(
        ab.PluginWarning, match=r"attn-backend-typo.*unknown hook\(s\) attn_backend_register"
    ):
        reg = _real("typo")
        assert reg.backends == {}
    assert any("attn_backend_register" in str(p) for p in reg.problems)


def test_core_refuses_a_feature_the_manifest_does_not_claim_before_attend_runs():
    ran = []

    def ignores_mask(call, q, k, v, ops):
        ran.append(call)
        return jnp.zeros((call.batch, call.q_len, call.q_heads, call.v_head_dim), q.dtype)

    backend = make_backend("nomask", mask=False, attend=ignores_mask)
    att = ab.Registry(plugins=[Plugin(backend)], autoload=False, probe=None).get(device="cpu")
    q, k, v = qkv()
    mask = jnp.ones((2, 1, 8, 8), bool)
    call, ops = ab.bind(q, k, v, mask=mask)
    with pytest.raises(
        ab.UnsupportedError, match=r"backend 'nomask' cannot serve .*feature 'mask' not supported"
    ):
        att.served(backend)(call, q, k, v, ops)
    assert ran == []
