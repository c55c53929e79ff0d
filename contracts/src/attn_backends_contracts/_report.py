"""The certificate (JSON) and the end-of-run summary table of a suite run."""

from __future__ import annotations

import datetime
import os
from collections import Counter
from importlib import metadata
from typing import Any

from .tolerances import OUTPUTS


def _suite_version() -> str:
    try:
        return metadata.version("attn-backends-contracts")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def certificate(suite: Any, exitstatus: int) -> dict[str, Any]:
    """The certificate dict: environment key fields plus what ran and how it went."""
    import attn_backends
    from attn_backends import certificates

    backend = suite.backend
    counts = Counter(r["outcome"] for r in suite.records)
    case_counts = Counter(r["outcome"] for r in suite.records if r["case"])
    families: dict[str, dict[str, dict[str, int]]] = {}
    for r in suite.records:
        cell = families.setdefault(r["family"], {}).setdefault(r["dtype"] or "-", {})
        cell[r["outcome"]] = cell.get(r["outcome"], 0) + 1
    failed = counts["failed"]
    return {
        **certificates.environment_key(backend, suite.platform),
        "api_version": attn_backends.API_VERSION,
        "backend_api_version": backend.api_version,
        "suite": "attn-backends-contracts",
        "suite_version": _suite_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "source": suite.source,
        # What `attn-backends matrix` names the library by (None: not installed).
        "distribution": suite.distribution,
        "mode": "quick" if suite.quick else "full",
        "only_families": suite.only,
        # The case families the full table draws for this manifest (a quick
        # table samples them).
        "full_table_families": suite.full_table_families,
        # Compiler flags change no operation of a program, but may its code:
        # a certificate says which it was made with.
        "xla_flags": os.environ.get("XLA_FLAGS") or None,
        "passed": exitstatus == 0 and failed == 0 and counts["passed"] > 0,
        "tests": {k: counts[k] for k in ("passed", "failed", "skipped")},
        "cases": {
            "run": sum(case_counts.values()),
            **{k: case_counts[k] for k in ("passed", "failed", "skipped")},
        },
        "families": families,
        "worst_errors": suite.worst,
        "failures": [
            {k: r[k] for k in ("test", "family", "case", "dtype", "message")}
            for r in suite.records
            if r["outcome"] == "failed"
        ],
        "capabilities": backend.capabilities.as_dict(),
    }


def summary_lines(suite: Any) -> list[str]:
    """Cases by family and dtype, worst error per output, failures with their case."""
    cert = suite.certificate or {}
    backend = suite.backend
    lines = [
        f"backend {backend.name} {backend.version} on {suite.platform} "
        f"({cert.get('device_kind')}), jax {cert.get('jax')}, "
        f"{'quick' if suite.quick else 'full'} table"
        + (f", XLA_FLAGS={cert['xla_flags']}" if cert.get("xla_flags") else ""),
        "",
        f"{'family':<14}{'dtype':<10}{'passed':>8}{'failed':>8}{'skipped':>9}",
    ]
    for fam, by_dtype in sorted(cert.get("families", {}).items()):
        for dtype, c in sorted(by_dtype.items()):
            lines.append(
                f"{fam:<14}{dtype:<10}{c.get('passed', 0):>8}{c.get('failed', 0):>8}"
                f"{c.get('skipped', 0):>9}"
            )
    lines += ["", "worst normalised error per output (1.0 = tolerance; see tolerances.py)",
              f"{'dtype':<10}" + "".join(f"{o:>10}" for o in OUTPUTS)]
    for dtype, worst in sorted(suite.worst.items()):
        cells = "".join(
            f"{worst[o]:>10.3g}" if o in worst else f"{'-':>10}" for o in OUTPUTS
        )
        lines.append(f"{dtype:<10}{cells}")
    failures = cert.get("failures", [])
    if failures:
        lines += ["", f"{len(failures)} failure(s):"]
        for f in failures:
            where = f["case"] or f["dtype"] or ""
            lines.append(f"  {f['test']} [{f['family']}] {where}: {f['message']}")
    verdict = "PASSED" if cert.get("passed") else "FAILED"
    lines += ["", f"conformance: {verdict} ({cert.get('tests')})"]
    if suite.certificate_path:
        lines.append(f"certificate: {suite.certificate_path}")
    return lines
