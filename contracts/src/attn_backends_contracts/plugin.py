"""The pytest plugin (entry point ``pytest11``) that runs the conformance suite.

Loaded into every pytest run of an environment where the distribution is
installed, so it is inert unless asked: importing it imports neither JAX nor
attn-backends, and without ``--attn-backend`` / ``--attn-backend-object`` (or
a provider from :func:`attn_backends_contracts.run_check`) its hooks do
nothing beyond adding the options, unless the run collected the suite's own
tests: that is a usage error, so a CI job that forgets the flag fails
instead of going green with everything skipped.

    pytest --pyargs attn_backends_contracts --attn-backend=NAME [--attn-json FILE]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ._case import Case
from ._paged_case import PagedSuiteCase

#: Fixture names the suite parametrizes; a test without them is left alone.
_PARAMETERS = ("attn_case", "attn_unclaimed", "attn_dtype", "attn_masking", "attn_dropout",
               "attn_paged", "attn_paged_dtype", "attn_paged_unclaimed")
#: The paged family's parameters: for a backend without paged support each test
#: gets one, the reason it does not apply, and skips with it.
_PAGED = ("attn_paged", "attn_paged_dtype", "attn_paged_unclaimed")
#: The one line a run of the suite with no backend named stops with.
NO_BACKEND = (
    "attn-backends conformance suite: no backend named; pass --attn-backend=NAME "
    "(an installed backend, see `attn-backends list`) or "
    "--attn-backend-object=MODULE:ATTR"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn-backends", "attn-backends conformance suite")
    group.addoption("--attn-backend", metavar="NAME", default=None,
                    help="run the conformance suite against the installed backend NAME")
    group.addoption("--attn-backend-object", metavar="MODULE:ATTR", default=None,
                    help="run it against a Backend object (module:attr or file.py:attr), "
                         "without installing it")
    group.addoption("--attn-device", metavar="PLATFORM", default=None,
                    help="platform to run on (cpu, gpu, tpu); default: JAX's default")
    group.addoption("--attn-quick", action="store_true", default=False,
                    help="the reduced case table (quick smoke run; not a certificate)")
    group.addoption("--attn-only", metavar="FAMILY,...", default=None,
                    help="run only these case families (e.g. causal,masked_rows)")
    group.addoption("--attn-json", metavar="FILE", default=None,
                    help="write the certificate JSON to FILE")


def _active(config: pytest.Config) -> bool:
    return bool(
        config.getoption("attn_backend", None)
        or config.getoption("attn_backend_object", None)
        or any(
            getattr(p, "attn_backend_provided", None) is not None
            for p in config.pluginmanager.get_plugins()
        )
    )


def pytest_configure(config: pytest.Config) -> None:
    if _active(config):
        config.pluginmanager.register(_Recorder(config), "attn-backends-contracts-recorder")


def _suite(config: pytest.Config) -> Any:
    from ._session import resolve

    return resolve(config) if _active(config) else None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = [n for n in _PARAMETERS if n in metafunc.fixturenames]
    if not names:
        return
    suite = _suite(metafunc.config)
    if suite is None:
        return  # pytest_collection_modifyitems stops the run with NO_BACKEND
    name = names[0]
    if name == "attn_case":
        metafunc.parametrize(name, suite.cases, ids=[c.id for c in suite.cases])
    elif name == "attn_unclaimed":
        values = suite.unclaimed()
        metafunc.parametrize(name, values, ids=[f"{k}-{v}" for k, v in values])
    elif name == "attn_dropout":
        from .cases import dropout_cases

        chosen = dropout_cases(suite.caps)
        metafunc.parametrize(name, chosen, ids=[c.id for c in chosen])
    elif name in _PAGED:
        _parametrize_paged(metafunc, name, suite)
    elif name == "attn_dtype":
        dtypes = sorted(suite.caps.dtypes)
        metafunc.parametrize(name, dtypes, ids=dtypes)
    else:
        features = suite.masking()
        metafunc.parametrize(name, features, ids=features)


def _parametrize_paged(metafunc: pytest.Metafunc, name: str, suite: Any) -> None:
    from . import paged_cases

    reason = paged_cases.not_applicable(suite.backend, suite.platform)
    if reason is not None:
        metafunc.parametrize(name, [reason], ids=["not-applicable"])
    elif name == "attn_paged_unclaimed":
        values = paged_cases.paged_unclaimed(suite.backend)
        metafunc.parametrize(name, values, ids=[f"{k}-{v}" for k, v in values])
    else:
        # An emulated (interpret-mode) backend runs the reduced table in full runs
        # too: each case interprets its kernel, slowly.
        quick = suite.quick or paged_cases.emulated(suite.backend, suite.platform)
        chosen = (paged_cases.paged_cases_for(suite.backend, quick=quick)
                  if name == "attn_paged" else paged_cases.paged_dtypes(suite.backend))
        chosen = paged_cases.as_served(chosen, suite.backend, suite.platform,
                                       lambda case: _paged_call(suite, case))
        metafunc.parametrize(name, chosen, ids=[c.id for c in chosen])


def _paged_call(suite: Any, case: Any) -> Any:
    """``case``'s PagedCall, as the registry binds it (float64 under x64, as it runs)."""
    from ._inputs import x64_for

    with x64_for(case.dtype):
        return suite.registry.explain_paged(device=suite.platform, backend=suite.backend.name,
                                            **case.call_args()).call


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collecting the suite's tests with no backend named is a usage error."""
    if _active(config):
        return
    if any("attn_suite" in getattr(item, "fixturenames", ()) for item in items):
        raise pytest.UsageError(NO_BACKEND)


@pytest.fixture(scope="session")
def attn_suite(request: pytest.FixtureRequest) -> Any:
    """The :class:`~attn_backends_contracts._session.Suite` of this run."""
    suite = _suite(request.config)
    if suite is None:
        raise pytest.UsageError(NO_BACKEND)
    return suite


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:300]
    if isinstance(report.longrepr, tuple):  # skip: (file, line, reason)
        return str(report.longrepr[2])[:300]
    return str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""


class _Recorder:
    """Collects each suite test's verdict; writes the certificate; prints the summary."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.meta: dict[str, dict[str, Any]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        only = self.config.getoption("attn_only", None)
        wanted = {f.strip() for f in only.split(",")} if only else None
        kept, dropped = [], []
        for item in items:
            fn = getattr(item, "function", None)
            fam = getattr(fn, "_attn_family", None)
            params = getattr(getattr(item, "callspec", None), "params", {})
            # A parameter set left empty (no dropout claimed) holds pytest's NOTSET.
            case = next((p for p in (params.get(n) for n in ("attn_case", "attn_dropout",
                                                               *_PAGED))
                         if isinstance(p, (Case, PagedSuiteCase))), None)
            if case is None and fam is None:
                kept.append(item)
                continue
            dtype = case.dtype if case is not None else params.get("attn_dtype")
            self.meta[item.nodeid] = {
                "test": getattr(fn, "__name__", item.name),
                "family": case.family if case is not None else fam,
                "case": case.id if case is not None else None,
                "dtype": dtype,
                "param": item.name,
            }
            if wanted is None or self.meta[item.nodeid]["family"] in wanted:
                kept.append(item)
            else:
                dropped.append(item)
        if dropped:
            self.config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        suite = self.config.stash.get(_key(), None)
        if suite is not None:
            # Only the numeric tests take attn_case; each asks for its case's outcome.
            params = (getattr(getattr(item, "callspec", None), "params", {})
                      for item in session.items)
            suite.plan([p["attn_case"] for p in params if "attn_case" in p])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        meta = self.meta.get(report.nodeid)
        suite = self.config.stash.get(_key(), None)
        if meta is None or suite is None:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            suite.records.append(
                {**meta, "outcome": report.outcome,
                 "message": "" if report.passed else _message(report)}
            )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        suite = self.config.stash.get(_key(), None)
        if suite is None:
            return
        from ._report import certificate

        suite.certificate = certificate(suite, int(exitstatus))
        path = self.config.getoption("attn_json", None)
        if path:
            Path(path).write_text(json.dumps(suite.certificate, indent=2, sort_keys=True))
            suite.certificate_path = str(path)
        for provider in self.config.pluginmanager.get_plugins():
            if hasattr(provider, "attn_backend_provided"):
                provider.suite = suite

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        suite = self.config.stash.get(_key(), None)
        if suite is None or suite.certificate is None:
            return
        from ._report import summary_lines

        terminalreporter.section("attn-backends conformance")
        for line in summary_lines(suite):
            terminalreporter.write_line(line)


def _key() -> Any:
    from ._session import SUITE_KEY

    return SUITE_KEY
