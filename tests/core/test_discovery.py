"""Discovery of real (throwaway) distributions: every "Broken plugins" row it owns.

Each test writes distributions into a temporary site directory (a module
plus a ``.dist-info`` with ``METADATA`` and ``entry_points.txt``) and puts it
on ``sys.path``, so importlib.metadata finds them exactly as it finds
installed plugins.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import warnings

import attn_backends as ab
import jax
import pytest
from _support import every_warning_an_error, make_dist
from attn_backends.choose import discovery as _discovery
from attn_backends.contract.errors import PluginConflictError


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    path.mkdir()
    # A well-behaved plugin beside the one under test: it must keep loading.
    make_dist(path, "attn-backend-bystander", "bystander")
    monkeypatch.syspath_prepend(str(path))
    for var in ("ATTN_BACKENDS_ONLY", "ATTN_BACKENDS_DISABLE", "ATTN_BACKENDS_NO_AUTOLOAD",
                "ATTN_BACKENDS_STRICT"):
        monkeypatch.delenv(var, raising=False)
    yield path
    importlib.invalidate_caches()


def test_installed_distribution_is_discovered_with_its_origin(site):
    make_dist(site, "attn-backend-good", "good")
    reg = ab.Registry()
    assert "good" in reg.backends and "bystander" in reg.backends
    origin = reg.origins["good"]
    assert (origin.distribution, origin.version, origin.plugin) == (
        "attn-backend-good", "0.3", "good"
    )


def test_plugin_raising_at_import_is_skipped_with_a_warning(site):
    make_dist(site, "attn-backend-broken", "broken", prelude="raise ImportError('no libfoo.so')\n")
    reg = ab.Registry()
    with pytest.warns(
        ab.PluginWarning,
        match=r"plugin 'broken' from attn-backend-broken 0.3: failed to import "
        r".*ImportError: no libfoo.so",
    ):
        backends = reg.backends
    assert "broken" not in backends and "bystander" in backends
    assert len(reg.problems) == 1 and "attn-backend-broken" in str(reg.problems[0])


def test_strict_mode_raises_instead(site, monkeypatch):
    make_dist(site, "attn-backend-broken", "broken", prelude="raise ImportError('no libfoo.so')\n")
    with pytest.raises(ab.PluginError, match=r"attn-backend-broken 0.3.*strict mode"):
        _ = ab.Registry(strict=True).backends
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", "1")
    with pytest.raises(ab.PluginError, match=r"attn-backend-broken"):
        _ = ab.Registry().backends


@pytest.mark.parametrize(
    "body,match",
    [
        ("raise RuntimeError('device query failed')",
         r"attn_backends_register\(\) raised RuntimeError: device query failed"),
        ("return [object()]", r"returned object, expected an attn_backends.Backend instance"),
        ("return B()", r"attn_backends_register\(\) must return a list of Backend, got B"),
        # A manifest that raises when read (say, from a malformed env var).
        ("return [type('C', (B,), {'capabilities': property(lambda self: 1 / 0)})()]",
         r"backend C: reading its manifest raised ZeroDivisionError: division by zero"),
    ],
)
def test_hook_that_raises_or_returns_junk_is_skipped(site, body, match):
    make_dist(site, "attn-backend-junk", "junk", body=body)
    reg = ab.Registry()
    with pytest.warns(ab.PluginWarning, match=r"attn-backend-junk 0.3: " + match):
        backends = reg.backends
    assert "junk" not in backends and "bystander" in backends


def test_hookimpl_with_a_bad_signature_is_skipped(site):
    module = make_dist(site, "attn-backend-badsig", "badsig")
    path = site / f"{module}.py"
    path.write_text(
        path.read_text().replace(
            "def attn_backends_register():", "def attn_backends_register(extra):"
        )
    )
    with pytest.warns(ab.PluginWarning, match=r"attn-backend-badsig 0.3: is not a valid plugin"):
        assert "badsig" not in ab.Registry().backends


def test_unsupported_api_version_names_both_versions(site):
    make_dist(site, "attn-backend-future", "future", api_version=2)
    with pytest.warns(
        ab.PluginWarning,
        match=r"attn-backend-future 0.3: backend 'future' implements api_version 2, "
        r"core supports \[1\]",
    ):
        assert "future" not in ab.Registry().backends


@pytest.mark.parametrize("order", ["aaa-first", "zzz-first"])
def test_two_distributions_claiming_one_name_is_an_error_naming_both(tmp_path, monkeypatch, order):
    first, second = tmp_path / "s1", tmp_path / "s2"
    make_dist(first, "aaa-dist", "dupe")
    make_dist(second, "zzz-dist", "dupe")
    paths = [first, second] if order == "aaa-first" else [second, first]
    for path in reversed(paths):
        monkeypatch.syspath_prepend(str(path))
    with pytest.raises(
        PluginConflictError,
        match=r"backend name 'dupe' is registered by several distributions: aaa-dist, zzz-dist",
    ):
        _ = ab.Registry(autoload=True).backends


def test_same_distribution_twice_on_sys_path_registers_once(tmp_path, monkeypatch):
    for folder in ("s1", "s2"):
        make_dist(tmp_path / folder, "attn-backend-twice", "twice")
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    with every_warning_an_error():
        reg = ab.Registry(autoload=True)
        assert "twice" in reg.backends and reg.problems == []


@pytest.mark.parametrize("setting", ["disable", "only"])
def test_disabled_or_not_allowed_plugins_are_never_imported(site, monkeypatch, setting):
    module = make_dist(site, "attn-backend-sentinel", "sentinel",
                       prelude="raise AssertionError('must never be imported')\n")
    if setting == "disable":
        monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "sentinel, other")
    else:
        monkeypatch.setenv("ATTN_BACKENDS_ONLY", "bystander")
    with every_warning_an_error():
        backends = ab.Registry().backends
    assert module not in sys.modules and "sentinel" not in backends
    assert ("bystander" in backends) is True


def test_no_autoload_loads_no_entry_points_but_keeps_in_process_plugins(site, monkeypatch):
    from _support import Plugin, make_backend

    make_dist(site, "attn-backend-good", "good")
    monkeypatch.setenv("ATTN_BACKENDS_NO_AUTOLOAD", "1")
    reg = ab.Registry(plugins=[Plugin(make_backend("inproc"))])
    assert list(reg.backends) == ["inproc"]
    assert reg.origins["inproc"].distribution == "<in-process>"


@pytest.mark.parametrize("value,autoload,strict", [("false", True, False), ("no", True, False),
                                                   ("Off", True, False), ("yes", False, True)])
def test_boolean_environment_variables_read_words(monkeypatch, value, autoload, strict):
    monkeypatch.setenv("ATTN_BACKENDS_NO_AUTOLOAD", value)
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", value)
    settings = _discovery.Settings.from_env()
    assert (settings.autoload, settings.strict) == (autoload, strict)
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", "maybe")
    with pytest.raises(ValueError, match=r"ATTN_BACKENDS_STRICT: expected 1/0 .* got 'maybe'"):
        _discovery.Settings.from_env()


def test_plugin_that_changes_jax_config_at_import_is_reported(site):
    make_dist(site, "attn-backend-meddler", "meddler",
              prelude="import jax\njax.config.update('jax_default_matmul_precision', 'highest')\n")
    try:
        with pytest.warns(
            ab.PluginWarning,
            match=r"attn-backend-meddler 0.3: changed global state at import: "
            r"jax.config jax_default_matmul_precision: None -> 'highest'",
        ):
            _ = ab.Registry().backends
    finally:
        jax.config.update("jax_default_matmul_precision", None)


def test_backend_for_another_jax_is_skipped_with_both_versions(site, monkeypatch, caplog):
    make_dist(site, "attn-backend-old", "old", jax_versions=">=0.4,<0.5")
    message = rf"backend 'old' supports jax >=0.4,<0.5, but jax {jax.__version__} is installed"
    # Asked for by name: a warning at load.
    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "old,bystander")
    with pytest.warns(ab.PluginWarning, match=message):
        _ = ab.Registry().backends
    # Not asked for: no warning (a user of other backends never sees it), logged.
    monkeypatch.delenv("ATTN_BACKENDS_ONLY")
    reg = ab.Registry()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="attn_backends"):
        warnings.simplefilter("error")
        _ = reg.backends
    assert re.search(message, caplog.text)
    q = jax.ShapeDtypeStruct((1, 4, 2, 8), "float32")
    exp = reg.get(device="cpu").explain(q, q, q)
    verdict = next(v for v in exp.verdicts if v.backend == "old")
    assert verdict.reasons == (f"jax {jax.__version__} is outside the supported range >=0.4,<0.5",)
    assert exp.chosen != "old"


def test_importing_a_jax_submodule_is_not_a_patch(site):
    make_dist(site, "attn-backend-importer", "importer",
              prelude="import jax.experimental.pallas.tpu\nimport jax.experimental.shard_map\n")
    with every_warning_an_error():
        assert "importer" in ab.Registry().backends


def test_plugin_that_patches_another_module_at_import_is_reported(site):
    import jax.nn

    original = jax.nn.dot_product_attention
    make_dist(site, "attn-backend-patcher", "patcher",
              prelude="import jax.nn\njax.nn.dot_product_attention = lambda *a, **k: None\n")
    try:
        with pytest.warns(
            ab.PluginWarning,
            match=r"attn-backend-patcher 0.3: changed global state at import: "
            r"replaced jax.nn.dot_product_attention",
        ):
            backends = ab.Registry().backends
        assert "patcher" in backends  # reported, not hidden; strict mode would raise
    finally:
        jax.nn.dot_product_attention = original


def test_two_in_process_plugins_claiming_one_name_conflict():
    from _support import Plugin, make_backend

    with pytest.raises(
        PluginConflictError, match=r"backend name 'x' is registered by several plugins"
    ):
        _ = ab.Registry(
            plugins=[Plugin(make_backend("x")), Plugin(make_backend("x"))], autoload=False
        ).backends


def test_backend_without_a_version_or_with_bad_priorities_is_skipped():
    from _support import Plugin, make_backend

    noversion, badprio = make_backend("noversion"), make_backend("badprio")
    type(noversion).version = None
    type(badprio).priority = {"cpu": "high"}
    with pytest.warns(ab.PluginWarning) as record:
        backends = ab.Registry(plugins=[Plugin(noversion, badprio)], autoload=False).backends
    assert backends == {}
    messages = " | ".join(str(r.message) for r in record)
    assert "backend 'noversion' has no version string" in messages
    assert "backend 'badprio': priority must map platform names to ints" in messages


def test_empty_only_list_means_no_list(site, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "")
    assert "bystander" in ab.Registry().backends
