"""Certificates as a user lives with them: kept per code and per kind of run, so a
quick pass reads as one, a failing change never erases what the old code earned,
and `list` counts only the verdicts of the code installed now."""

from __future__ import annotations

import pytest
from _support import make_backend
from attn_backends.probe import certificates, verdicts
from attn_backends_cli import report

OLD = {"backend": "aaa", "core": "ccc", "suite": "sss"}
NEW = {"backend": "bbb", "core": "ccc", "suite": "sss"}


@pytest.fixture
def code(monkeypatch):
    """Which code is "installed now": set ``code.digests``."""

    class Code:
        digests = OLD

    monkeypatch.setattr(certificates, "code_digests", lambda backend: Code.digests)
    monkeypatch.setattr(report, "code_digests", lambda backend: Code.digests)
    return Code


def _certify(backend, *, passed=True, mode="full", date="2026-12-01T10:00:00+00:00"):
    record = {**certificates.environment_key(backend, "cpu"), "passed": passed, "mode": mode,
              "only_families": None, "date": date,
              "cases": {"run": 44, "passed": 44 if passed else 40}}
    assert certificates.store(record) is not None


def test_a_quick_pass_reads_as_a_quick_pass(code):
    backend = make_backend("mine")
    _certify(backend, mode="quick")
    assert report.certificate_summary(backend, "cpu") == (
        "passed (quick run; only a full run certifies): 44/44 cases")
    assert not certificates.status(backend, "cpu").counts


def test_a_failing_change_keeps_the_old_codes_certificate(code):
    backend = make_backend("mine")
    _certify(backend)                                    # the old code passes
    code.digests = NEW
    _certify(backend, passed=False, date="2026-12-01T11:00:00+00:00")  # a broken change
    assert report.certificate_summary(backend, "cpu") == "FAILED (full run): 40/44 cases"
    code.digests = OLD                                   # the change is reverted
    assert certificates.status(backend, "cpu").counts
    assert report.certificate_summary(backend, "cpu") == "yes: 44/44 cases"


def test_other_code_voids_with_the_newest_certificates_reasons(code):
    backend = make_backend("mine")
    _certify(backend)
    code.digests = {**NEW, "backend": "zzz"}
    found = certificates.status(backend, "cpu")
    assert not found.counts and found.certificate["code_digests"] == OLD
    assert found.void == ("the backend's code changed since it was certified "
                          "(digest aaa then, zzz now)",)


def test_a_quick_run_never_replaces_a_full_pass_of_the_same_code(code):
    backend = make_backend("mine")
    _certify(backend)
    _certify(backend, passed=False, mode="quick", date="2026-12-01T12:00:00+00:00")
    assert certificates.status(backend, "cpu").counts


def test_list_counts_only_the_verdicts_of_the_code_installed_now(code):
    backend = make_backend("mine")
    base = {"backend": "mine", "jax": report.versions()["jax"], "core_digest": "ccc"}
    for name, digest, passed in (("a", "aaa", False), ("b", "aaa", False), ("c", "bbb", True)):
        record = {"key": {**base, "backend_digest": digest, "n": name}, "passed": passed,
                  "reasons": [] if passed else ["wrong"], "seconds": 1.0}
        verdicts.write(record["key"], record)
    assert report.probe_summary(backend) == "0 ok, 2 quarantined"
    code.digests = NEW
    assert report.probe_summary(backend) == "1 ok"
