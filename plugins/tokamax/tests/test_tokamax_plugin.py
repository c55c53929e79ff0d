"""tokamax's backends without running tokamax: packaging, laziness, refusals, ranking."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from attn_backend_tokamax import TOKAMAX_CERTIFIED, _environment, interpret_mode

NAMES = ("tokamax_xla", "tokamax_xla_chunked", "tokamax_mosaic_tpu", "tokamax_triton",
         "tokamax_mosaic_gpu")
S = jax.ShapeDtypeStruct
Q, KV = S((2, 64, 4, 32), jnp.float32), S((2, 64, 2, 32), jnp.float32)


def _explain(only, **kw):
    return ab.Registry(only=list(only), probe=None).get(device="cpu").explain(Q, KV, KV, **kw)


def _verdict(explanation, name):
    return next(v for v in explanation.verdicts if v.backend == name)


def test_distribution_pins_the_certified_tokamax_and_registers_every_backend():
    requires = importlib.metadata.requires("attn-backend-tokamax")
    pinned = sorted(r.split("==")[1].split(";")[0] for r in requires if r.startswith("tokamax"))
    assert pinned == sorted(TOKAMAX_CERTIFIED)  # each certified release, one per Python line
    installed = _environment.tokamax_version()
    assert installed in TOKAMAX_CERTIFIED
    entries = importlib.metadata.entry_points(group="attn_backends")
    assert {e.name for e in entries if e.value.startswith("attn_backend_tokamax.")} == set(NAMES)
    registry = ab.Registry(only=list(NAMES), probe=None)
    for name in NAMES:
        backend = registry.backend(name)
        assert backend.version.endswith(f"+tokamax.{installed}")


def test_import_and_list_do_not_import_tokamax():
    code = (
        "import sys, attn_backends\n"
        "from attn_backends_cli.main import main\n"
        "assert main(['list']) == 0\n"
        "ab = attn_backends.Registry(only=['tokamax_xla', 'tokamax_mosaic_tpu', 'tokamax_triton',"
        " 'tokamax_mosaic_gpu'], probe=None)\n"
        "print(sorted(ab.backends))\n"
        "import jax\n"
        "x = jax.ShapeDtypeStruct((1, 64, 2, 32), 'bfloat16')\n"
        "print(ab.get(device='gpu').explain(x, x, x, causal=True))\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'tokamax')\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokamax_xla_chunked" in proc.stdout and "tokamax_mosaic_tpu" in proc.stdout
    # The GPU backends' reasons (jax line, default device) are read without tokamax.
    assert "tokamax_mosaic_gpu" in proc.stdout and "certify on a Hopper" in proc.stdout


@pytest.mark.parametrize("installed, says", [
    (None, "tokamax is not installed: pip install attn-backend-tokamax (tokamax 0.0.17 on "
           "Python >= 3.12, 0.0.12 on 3.11)"),
    ("0.0.11", "tokamax 0.0.11 is installed, but these backends were certified with "
               "tokamax 0.0.12 (on jax 0.10), 0.0.17 (on jax 0.12) only"),
])
def test_missing_or_other_tokamax_is_a_refusal_in_explain(monkeypatch, installed, says):
    monkeypatch.setattr(_environment, "tokamax_version", lambda: installed)
    explanation = _explain(["tokamax_xla", "reference"], causal=True)
    assert explanation.chosen == "reference"
    assert any(says in r for r in _verdict(explanation, "tokamax_xla").reasons)
    assert says in str(explanation)


def test_softcap_with_bias_is_declined_with_the_reason():
    bias = S((1, 4, 64, 64), jnp.float32)
    explanation = _explain(["tokamax_xla", "reference"], bias=bias, softcap=20.0)
    assert explanation.chosen == "reference"
    (reason,) = _verdict(explanation, "tokamax_xla").reasons
    assert "tokamax caps scale*q.k + bias" in reason


def test_the_registry_ranks_ours_and_tokamax_together_on_cpu():
    explanation = _explain(["xla_native", "reference", *NAMES], causal=True)
    order = [v.backend for v in explanation.verdicts]
    assert explanation.chosen == "xla_native"
    assert order.index("tokamax_xla") < order.index("tokamax_xla_chunked") < order.index(
        "reference")
    assert _verdict(explanation, "tokamax_xla").accepted
    mosaic = " ".join(_verdict(explanation, "tokamax_mosaic_tpu").reasons)
    assert "platform 'cpu' not in ['tpu']" in mosaic and "ATTN_BACKENDS_PALLAS_INTERPRET" in mosaic
    with interpret_mode():
        explanation = _explain(["tokamax_mosaic_tpu"], causal=True)
    assert _verdict(explanation, "tokamax_mosaic_tpu").accepted


def test_mosaic_tpu_declines_what_tokamax_refuses_there():
    bias = S((1, 4, 64, 64), jnp.float32)
    lengths = S((2,), jnp.int32)
    with interpret_mode():
        for kw, feature in (({"bias": bias}, "bias"), ({"kv_lengths": lengths}, "lengths"),
                            ({"mask": S((2, 1, 64, 64), jnp.bool_)}, "mask")):
            reasons = _verdict(_explain(["tokamax_mosaic_tpu"], **kw), "tokamax_mosaic_tpu").reasons
            assert f"feature {feature!r} not supported" in reasons


PAGED = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, dtype="float32")


def _explain_paged(only, **kw):
    return ab.Registry(only=list(only), probe=None).explain_paged(device="cpu", **{**PAGED, **kw})


def test_paged_calls_rank_the_xla_ones_below_ours_and_refuse_what_they_lack(monkeypatch):
    explanation = _explain_paged(["xla_native", "reference", *NAMES], softcap=5.0,
                                 window=(7, None))
    order = [v.backend for v in explanation.verdicts]
    assert explanation.chosen == "xla_native"
    assert order.index("tokamax_xla") < order.index("tokamax_xla_chunked") < order.index(
        "reference")
    assert _verdict(explanation, "tokamax_xla_chunked").accepted
    assert "no paged support" in " ".join(_verdict(explanation, "tokamax_mosaic_tpu").reasons)
    with jax.enable_x64(True):
        wide = _verdict(_explain_paged(["tokamax_xla"], dtype="float64"), "tokamax_xla")
    assert not wide.accepted and "dtype float64 not in" in " ".join(wide.reasons)
    monkeypatch.setattr(_environment, "tokamax_version", lambda: None)
    missing = _verdict(_explain_paged(["tokamax_xla"]), "tokamax_xla")
    assert not missing.accepted and "tokamax is not installed" in " ".join(missing.reasons)
