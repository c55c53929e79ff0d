"""The one store of verdicts and certificates, and the one reader of ATTN_BACKENDS_*.

Store: a write is atomic (a writer killed mid-write leaves the old record), an
unreadable record is reported once, naming its file, and read as none (never a
crash, never a pass), and an unwritable cache works in memory with one warning.
Settings: every variable's bad value is an error naming the variable, what it
read and what it takes; the CLI's flags read the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import traceback
import warnings
from pathlib import Path

import attn_backends as ab
import pytest
from _support import make_backend
from attn_backends.choose.discovery import Settings
from attn_backends.contract.environment import cache_dir, env_setting
from attn_backends.probe import certificates as _certificates
from attn_backends.probe import prober as _probe
from attn_backends.probe import store as _store
from attn_backends.probe import verdicts as _verdicts
from attn_backends_cli.main import main

CORE_SRC = Path(ab.__file__).parent


# -- settings ---------------------------------------------------------------


def _discover() -> object:
    return ab.Registry().backends


def _probe_budget() -> object:
    return _probe.Prober().budget_s


def _cache() -> object:
    return _verdicts.records()  # every store use reads the cache folder


def _tuning() -> object:
    from attn_backends.contract.environment import tuning_table

    return tuning_table(None)


def _agree_timeout() -> object:
    from attn_backends.parallel.hosts import agree_timeout_s

    return agree_timeout_s()


#: Each ATTN_BACKENDS_* variable core reads: how it is read, and what it takes.
SETTINGS = {
    "ATTN_BACKENDS_ONLY": (_discover, "comma-separated backend names like reference,xla_native"),
    "ATTN_BACKENDS_DISABLE": (_discover, "comma-separated backend names like reference,xla_native"),
    "ATTN_BACKENDS_NO_AUTOLOAD": (_discover, "1/0 (or true/false, yes/no, on/off)"),
    "ATTN_BACKENDS_STRICT": (_discover, "1/0 (or true/false, yes/no, on/off)"),
    "ATTN_BACKENDS_CACHE_DIR": (_cache, "an absolute directory path (~ allowed)"),
    "ATTN_BACKENDS_PROBE_BUDGET_S": (_probe_budget, "a number of seconds > 0"),
    "ATTN_BACKENDS_TUNING": (_tuning, "the path of a tuning table (attn-backends tune --out)"),
    "ATTN_BACKENDS_AGREE_TIMEOUT_S": (_agree_timeout, "a number of seconds > 0"),
}

BAD_VALUES = [
    ("ATTN_BACKENDS_ONLY", "reference xla_native"),  # a comma forgotten
    ("ATTN_BACKENDS_ONLY", "reference;xla_native"),
    ("ATTN_BACKENDS_DISABLE", ", ,"),  # names no backend
    ("ATTN_BACKENDS_NO_AUTOLOAD", "maybe"),
    ("ATTN_BACKENDS_STRICT", "2"),
    ("ATTN_BACKENDS_CACHE_DIR", "relative/cache"),  # each working directory its own cache
    ("ATTN_BACKENDS_PROBE_BUDGET_S", "abc"),
    ("ATTN_BACKENDS_PROBE_BUDGET_S", "0"),
    ("ATTN_BACKENDS_PROBE_BUDGET_S", "-5"),
    ("ATTN_BACKENDS_PROBE_BUDGET_S", "nan"),
    ("ATTN_BACKENDS_PROBE_BUDGET_S", "inf"),
    ("ATTN_BACKENDS_AGREE_TIMEOUT_S", "soon"),
    ("ATTN_BACKENDS_AGREE_TIMEOUT_S", "0"),
]


@pytest.mark.parametrize("var,value", BAD_VALUES)
def test_a_bad_value_is_an_error_naming_the_variable_what_it_read_and_what_it_takes(
        monkeypatch, var, value):
    read, accepts = SETTINGS[var]
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as raised:
        read()
    assert str(raised.value) == f"{var}: expected {accepts}, got {value!r}"


def test_the_table_above_holds_every_variable_core_reads_and_only_the_helper_reads_them():
    read = set()
    readers = set()
    cli = CORE_SRC.parents[2] / "cli" / "src" / "attn_backends_cli"
    for root in (CORE_SRC, cli):
        for path in root.rglob("*.py"):
            text = path.read_text()
            read |= set(re.findall(r'"(ATTN_BACKENDS_[A-Z][A-Z_]*)"', text))
            if re.search(r"os\.environ|os\.getenv|getenv\(", text):
                readers.add(f"{root.name}/{path.relative_to(root).as_posix()}")
    assert read == set(SETTINGS)
    # environment.py holds the helper (and reads XDG_CACHE_HOME); report.py
    # only lists the variables set, for `attn-backends doctor`.
    assert readers == {"attn_backends/contract/environment.py", "attn_backends_cli/report.py"}


def test_good_values_still_read(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTN_BACKENDS_PROBE_BUDGET_S", " 2.5 ")
    assert _probe.Prober().budget_s == 2.5
    monkeypatch.setenv("ATTN_BACKENDS_PROBE_BUDGET_S", "")
    assert _probe.Prober().budget_s == _probe.DEFAULT_BUDGET_S
    assert _probe.Prober(budget_s=7.0).budget_s == 7.0
    monkeypatch.setenv("ATTN_BACKENDS_ONLY", " reference , xla_native,")
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "attn-backend.x_1")
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", " ON ")
    monkeypatch.setenv("ATTN_BACKENDS_NO_AUTOLOAD", "0")
    assert Settings.from_env() == Settings(autoload=True, strict=True,
                                           only=frozenset({"reference", "xla_native"}),
                                           disable=frozenset({"attn-backend.x_1"}))
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", "~/c")
    assert cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("options", [None, "some-options"])
def test_a_bad_cache_dir_stops_a_probe_with_its_own_message(monkeypatch, options):
    backend, runs = make_backend("fake"), []
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", "cache")
    prober = _probe.Prober(runner=lambda *a: runs.append(a) or [])
    with pytest.raises(ValueError) as raised:
        prober.verdict(backend, _probe.sample_call(backend, "float32", frozenset()), "cpu", options)
    assert str(raised.value) == ("ATTN_BACKENDS_CACHE_DIR: expected an absolute directory path "
                                 "(~ allowed), got 'cache'")
    shown = "".join(traceback.format_exception(raised.value))
    assert "During handling" not in shown and runs == []  # one clean error, nothing probed


def test_an_overridden_setting_does_not_read_its_variable(monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", "maybe")
    assert Settings.from_env(strict=False).strict is False
    with pytest.raises(ValueError, match="ATTN_BACKENDS_STRICT"):
        Settings.from_env()


def test_env_setting_blank_is_unset_and_any_parser_error_names_the_variable(monkeypatch):
    def parse(text: str) -> int:
        return int(text)  # its own message ("invalid literal ...") is replaced

    monkeypatch.setenv("ATTN_BACKENDS_TEST_X", "   ")
    assert env_setting("ATTN_BACKENDS_TEST_X", parse, accepts="an integer", default=3) == 3
    monkeypatch.setenv("ATTN_BACKENDS_TEST_X", "x1")
    with pytest.raises(ValueError) as raised:
        env_setting("ATTN_BACKENDS_TEST_X", parse, accepts="an integer", default=3)
    assert str(raised.value) == "ATTN_BACKENDS_TEST_X: expected an integer, got 'x1'"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_import_with_a_bad_budget_works_and_the_first_probe_names_the_variable(isolated_cache):
    script = textwrap.dedent("""
        import sys
        import attn_backends as ab
        print("imported; probe layer loaded:", "attn_backends.probe" in sys.modules)
        import jax.numpy as jnp
        sys.path.insert(0, {tests!r})
        from _support import Plugin, make_backend
        q = jnp.ones((1, 8, 2, 16))
        registry = ab.Registry(plugins=[Plugin(make_backend("fake"))], autoload=False)
        try:
            registry.get(device="cpu")(q, q, q)
        except ValueError as exc:
            print("ValueError:", exc)
    """).format(tests=str(Path(__file__).resolve().parents[1]))
    env = {**os.environ, "ATTN_BACKENDS_PROBE_BUDGET_S": "abc", "JAX_PLATFORMS": "cpu",
           "ATTN_BACKENDS_CACHE_DIR": str(isolated_cache)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "imported; probe layer loaded: False",
        "ValueError: ATTN_BACKENDS_PROBE_BUDGET_S: expected a number of seconds > 0, got 'abc'",
    ]


def test_the_cli_reports_a_bad_variable_as_a_message(capsys, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", "sometimes")
    registry = ab.Registry()
    monkeypatch.setattr(ab, "registry", registry)
    monkeypatch.setattr(ab.choose.registry, "registry", registry)
    assert main(["list"]) == 2
    assert capsys.readouterr().err == (
        "attn-backends list: ATTN_BACKENDS_STRICT: expected 1/0 (or true/false, yes/no, on/off), "
        "got 'sometimes'\n")


EXPLAIN = ["explain", "--q", "1,8,2,64", "--kv", "1,8,2,64"]


@pytest.mark.parametrize("argv,message", [
    (["bench", "--heads", "abc"], "argument --heads: expected an integer >= 1, got 'abc'"),
    (["bench", "--head-dim", "0"], "argument --head-dim: expected an integer >= 1, got '0'"),
    (["bench", "--seq", "512,abc"],
     "argument --seq: expected comma-separated lengths >= 1 like 512,1024, got '512,abc'"),
    (["explain", "--q", "1,8,64", "--kv", "1,8,2,64"],
     "argument --q: expected 4 comma-separated integers like 1,128,8,64, got '1,8,64'"),
    (["explain", "--q", "1,8,2,64", "--kv", "a,8,2,64"],
     "argument --kv: expected 4 comma-separated integers like 1,128,8,64, got 'a,8,2,64'"),
    ([*EXPLAIN, "--dv", "x"], "argument --dv: expected an integer >= 1, got 'x'"),
    ([*EXPLAIN, "--softcap", "-1"], "argument --softcap: expected a number > 0, got '-1'"),
    ([*EXPLAIN, "--window", "8"],
     "argument --window: expected LEFT,RIGHT: two integers, either may be empty, got '8'"),
])
def test_cli_flag_errors_name_the_flag_what_it_takes_and_what_it_got(capsys, argv, message):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"error: {message}"), last


# -- the store --------------------------------------------------------------


def _call(backend):
    return _probe.sample_call(backend, "float32", frozenset())


def _truncate(path: Path) -> None:
    text = path.read_text()
    path.write_text(text[: len(text) // 2])


def _one_store_warning(record, path: Path) -> str:
    messages = [str(w.message) for w in record if issubclass(w.category, _store.StoreWarning)]
    assert len(messages) == 1, messages
    assert str(path) in messages[0]
    return messages[0]


CORRUPTIONS = {
    "truncated": _truncate,
    "not JSON": lambda path: path.write_text("{not json"),
    "a list": lambda path: path.write_text("[]"),
    "passed as a word": lambda path: path.write_text(
        json.dumps({**json.loads(path.read_text()), "passed": "yes"})),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_an_unreadable_verdict_is_reported_once_and_the_backend_is_probed_again(corruption):
    backend, runs = make_backend("fake"), []
    call = _call(backend)
    first = _probe.Prober(runner=lambda *a: runs.append(a) or [])
    assert first.verdict(backend, call, "cpu").passed
    (path,) = (_verdicts.folder()).glob("*.json")
    CORRUPTIONS[corruption](path)

    # A new process (a fresh prober) must not take the damaged file for a pass.
    again = _probe.Prober(runner=lambda *a: runs.append(a) or ["wrong now"])
    with pytest.warns(ab.AttnBackendsWarning) as record:
        verdict = again.verdict(backend, call, "cpu")
    message = _one_store_warning(record, path)
    assert message.startswith(f"probe cache entry {path} is unreadable (")
    assert message.endswith("it is ignored: the backend is probed again")
    assert (verdict.passed, verdict.reasons, verdict.source) == (False, ("wrong now",), "run")
    assert len(runs) == 2
    assert json.loads(path.read_text())["reasons"] == ["wrong now"]  # rewritten whole


def test_a_damaged_file_is_reported_once_not_on_every_read():
    backend = make_backend("fake")
    key = _probe.probe_key(backend, _call(backend), "cpu")
    path = _verdicts.write(key, {"passed": True, "reasons": [], "seconds": 0.1})
    assert path is not None and _verdicts.read(key)["passed"] is True
    _truncate(path)
    with pytest.warns(_store.StoreWarning) as record:
        assert _verdicts.read(key) is None
    _one_store_warning(record, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _verdicts.read(key) is None  # the same damage: already reported
        (entry,) = _verdicts.records()  # listed, as unreadable
        assert entry["path"] == str(path) and entry["unreadable"].startswith("not valid JSON")
    assert _verdicts.clear("some-other-backend") == 1  # nothing can use it: cleared anyway
    assert not path.exists()


def _certificate(backend) -> dict:
    return {**_certificates.environment_key(backend, "cpu"), "passed": True, "mode": "full",
            "only_families": None, "cases": {"run": 3, "passed": 3}}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_an_unreadable_certificate_is_reported_once_and_counts_as_none(corruption):
    from attn_backends import certificates  # the public module: same functions

    backend, runs = make_backend("certified"), []
    path = certificates.store(_certificate(backend))
    assert path is not None and certificates.status(backend, "cpu").counts
    CORRUPTIONS[corruption](path)
    with pytest.warns(ab.AttnBackendsWarning) as record:
        status = certificates.status(backend, "cpu")
    message = _one_store_warning(record, path)
    assert message.startswith(f"certificate cache entry {path} is unreadable (")
    assert message.endswith("it is ignored: the backend counts as not certified")
    assert status == certificates.CertificateStatus(None) and not status.counts
    # ... so a probe runs (and fails) instead of the certificate passing it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once already
        verdict = _probe.Prober(runner=lambda *a: runs.append(a) or ["wrong"]).verdict(
            backend, _call(backend), "cpu")
    assert (verdict.passed, verdict.source, len(runs)) == (False, "run", 1)


def test_a_certificate_is_written_atomically_and_read_back():
    backend = make_backend("certified")
    path = _certificates.store(_certificate(backend))
    assert path is not None and path.parent == cache_dir() / "certificates"
    assert json.loads(path.read_text()) == _certificate(backend)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


KILLED_WRITER = """
import os, signal
from attn_backends.probe import store

real_write = os.write

def write_half_then_die(fd, data):
    real_write(fd, bytes(data[: len(data) // 2]))
    os.kill(os.getpid(), signal.SIGKILL)

os.write = write_half_then_die
store.Store("kill-test", what="test", holds="tests", ignored="-").write(
    "record", {"value": "new", "padding": "x" * 100000})
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_writer_killed_mid_write_leaves_the_old_record_readable(isolated_cache):
    store = _store.Store("kill-test", what="test", holds="tests", ignored="-")
    old = {"value": "old"}
    path = store.write("record", old)
    assert path is not None
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(isolated_cache)}
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER], env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL  # it died mid-write, not after it
    # It did start writing: some file of the folder holds a part of the new record.
    partial = [p for p in path.parent.iterdir() if p.read_text().startswith('{\n  "padding": "xx')]
    assert partial, sorted(p.name for p in path.parent.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unreadable to report
        assert store.read("record") == old
        assert [(e.path, e.record) for e in store.entries()] == [(path, old)]


def test_a_failed_write_leaves_the_old_record_and_no_temporary_file(monkeypatch):
    store = _store.Store("fail-test", what="test", holds="tests", ignored="-")
    path = store.write("record", {"value": "old"})

    def fsync_fails(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_store.os, "fsync", fsync_fails)
    with pytest.warns(_store.StoreWarning, match="No space left on device"):
        assert store.write("record", {"value": "new"}) is None
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"value": "old"}
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]


@pytest.fixture
def unwritable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(blocker / "cache"))
    return blocker / "cache"


def test_an_unwritable_cache_keeps_verdicts_in_memory_with_one_warning(unwritable_cache):
    backend, runs = make_backend("fake"), []
    prober = _probe.Prober(runner=lambda *a: runs.append(a) or [])
    with pytest.warns(ab.AttnBackendsWarning) as record:
        assert prober.verdict(backend, _call(backend), "cpu").passed
    (message,) = [str(w.message) for w in record]
    assert message.startswith(f"probe cache directory {unwritable_cache / 'probes'} is not "
                              "writable (")
    assert message.endswith("probe verdicts are kept in memory only, for this process "
                            "(set ATTN_BACKENDS_CACHE_DIR)")
    causal = _probe.sample_call(backend, "float32", frozenset({"causal"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, whatever is written next
        assert prober.verdict(backend, causal, "cpu").passed
        # a second prober of this process reads them from the store's memory
        fresh = _probe.Prober(runner=lambda *a: runs.append(a) or ["never asked"])
        assert fresh.verdict(backend, causal, "cpu").passed
        assert len(_verdicts.records()) == 2
    assert len(runs) == 2


def test_an_unwritable_cache_keeps_certificates_in_memory_with_one_warning(unwritable_cache):
    first, second = make_backend("one"), make_backend("two")
    unwritable = r"^certificate cache directory .* is not writable"
    with pytest.warns(_store.StoreWarning, match=unwritable):
        assert _certificates.store(_certificate(first)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _certificates.store(_certificate(second)) is None
        assert _certificates.status(first, "cpu").counts
        assert _certificates.status(second, "cpu").counts
