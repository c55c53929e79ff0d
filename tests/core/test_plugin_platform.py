"""A platform JAX knows but core does not: a PJRT plugin's, here "neuron".

A distribution declares a backend for ``platforms={"neuron"}``; with JAX
reporting that platform (simulated: ``jax.extend.backend.backends()``, the one
table core reads the platforms from, is patched) it is discovered, listed,
explained and selected for ``device="neuron"``; without it, ``device="neuron"``
is refused naming what JAX reports and what to install. No core change was
needed for the new name: that is the promise tested.
"""

from __future__ import annotations

import importlib
import json

import attn_backends as ab
import jax.extend.backend
import pytest
from _support import make_dist, qkv
from attn_backends.contract import environment
from attn_backends_cli import main as cli

NEURON_BACKEND = '''
from attn_backends import Backend, Capabilities


class OnNeuron(Backend):
    name = "on_neuron"
    version = "1.0"
    capabilities = Capabilities(platforms={"neuron"}, causal=True, gqa=True)
    priority = {"neuron": 5}

    def attend(self, call, q, k, v, operands, options=None):
        raise AssertionError("never run: JAX's neuron platform is simulated here")

'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site holding attn-backend-neuron (the backend above) and a cpu-only bystander."""
    path = tmp_path / "site"
    make_dist(path, "attn-backend-neuron", "on_neuron", prelude=NEURON_BACKEND,
              body="return [OnNeuron()]")
    make_dist(path, "attn-backend-bystander", "bystander")
    monkeypatch.syspath_prepend(str(path))
    monkeypatch.delenv("ATTN_BACKENDS_NO_AUTOLOAD")
    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "on_neuron,bystander")  # not the installed ones
    yield path
    importlib.invalidate_caches()


@pytest.fixture
def jax_reports(monkeypatch):
    """``jax_reports("cpu", "neuron")``: JAX's table of backends holds those names."""
    environment.visible_platforms.cache_clear()

    def report(*names: str) -> None:
        monkeypatch.setattr(jax.extend.backend, "backends", lambda: dict.fromkeys(names))
        environment.visible_platforms.cache_clear()

    yield report
    environment.visible_platforms.cache_clear()


def test_a_plugin_platform_is_discovered_listed_explained_and_selected(
    site, jax_reports, monkeypatch, capsys
):
    jax_reports("cpu", "neuron")
    registry = ab.Registry(probe=None)
    assert registry.backends["on_neuron"].capabilities.platforms == {"neuron"}
    assert registry.origins["on_neuron"].distribution == "attn-backend-neuron"

    monkeypatch.setattr(cli, "_registry", lambda: registry)
    assert cli.main(["list", "--json"]) == 0
    listed = {r["backend"]: r for r in json.loads(capsys.readouterr().out)["backends"]}
    assert listed["on_neuron"]["capabilities"]["platforms"] == ["neuron"]
    assert listed["on_neuron"]["priority"] == {"neuron": 5}
    assert cli.main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "on_neuron" in line)
    assert "attn-backend-neuron" in row and " neuron " in row

    attention = registry.get(device="neuron")
    assert attention.present
    q, k, v = qkv()
    explained = attention.explain(q, k, v, causal=True)
    assert (explained.platform, explained.chosen) == ("neuron", "on_neuron")
    bystander = next(v for v in explained.verdicts if v.backend == "bystander")
    assert bystander.reasons == ("platform 'neuron' not in ['cpu']",)

    assert cli.main(["explain", "--device", "neuron", "--q", "1,8,2,16",
                     "--kv", "1,8,2,16", "--causal", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"] == "on_neuron"
    # On cpu the neuron backend is refused by its manifest, the bystander chosen.
    on_cpu = registry.get(device="cpu").explain(q, k, v, causal=True)
    assert on_cpu.chosen == "bystander"
    assert ("platform 'cpu' not in ['neuron']" in
            next(v for v in on_cpu.verdicts if v.backend == "on_neuron").reasons)


def test_a_plugin_platform_jax_does_not_report_is_refused_saying_what_to_install(
    site, jax_reports
):
    jax_reports("cpu")
    registry = ab.Registry(probe=None)
    assert "on_neuron" in registry.backends  # discovered; only the platform is missing
    with pytest.raises(
        ab.PlatformUnavailableError,
        match=r"device='neuron': JAX reports no 'neuron' platform here \(JAX reports: cpu\)\. "
        r".*install the plugin package that provides 'neuron'.*jax.devices\('neuron'\)",
    ):
        registry.get(device="neuron")


def test_jax_names_reach_the_contract_through_the_alias_table(jax_reports):
    jax_reports("cuda", "cpu", "neuron")
    assert environment.visible_platforms() == ("cpu", "gpu", "neuron")
    assert environment.resolve("CUDA") == ("gpu", True)
    assert environment.resolve("neuron") == ("neuron", True)
    assert environment.lowering_names("neuron") == ("neuron",)
    assert environment.lowering_names("gpu") == ("cuda", "rocm")


@pytest.mark.parametrize(
    "platforms, match",
    [
        (set(), r"platforms is empty; name at least one of \['cpu', 'gpu', 'tpu'\] or a JAX"),
        ({"gpuu"}, r"platforms: 'gpuu' is not a platform name; did you mean 'gpu'\?"),
        ({"cpu", "cpus"}, r"platforms: 'cpus' is not a platform name; did you mean 'cpu'\?"),
        ({"GPU"}, r"platforms: 'GPU' is not a platform name; a platform is .* lowercase"),
        ({"my-chip"}, r"platforms: 'my-chip' is not a platform name"),
        ({"cuda"}, r"platforms: 'cuda' is JAX's name for the contract's 'gpu'; write 'gpu'"),
        ({7}, r"platforms: 7 is not a platform name"),
    ],
)
def test_manifest_platform_names_catch_junk_and_typos(platforms, match):
    with pytest.raises(ValueError, match=r"^Capabilities: " + match):
        ab.Capabilities(platforms=platforms)


def test_any_other_lowercase_name_is_a_platform_a_plugin_may_report():
    for name in ("neuron", "xpu", "npu", "metal", "my_chip2"):
        assert ab.Capabilities(platforms={name, "cpu"}).platforms == {name, "cpu"}
