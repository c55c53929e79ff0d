"""`attn-backends matrix`: which library's backend passed which contract family, read
from certificates (the JSON files ``attn-backends check NAME --json FILE`` writes).

One column per certificate (a backend on one jax line and platform), one row
per contract family of the suite. A family's cell sums the family's tests over
dtypes:

- ``pass``: every test of the family ran and passed (``pass (N skipped)``: the
  others were skipped, see below);
- ``FAIL F/N``: F of the family's N tests failed;
- ``unsupported``: none ran, because the backend declares it does not serve
  them: the manifest claims none of the features the family's cases use (the
  suite drew no case for it), or the suite skipped every test as not claimed
  (``differentiable=False``, no paged support) or as declined by the backend's
  ``check()``;
- ``nothing to refuse``: a refusal family (``unclaimed``) of a manifest that
  claims everything it would check is refused;
- ``not run``: the certificate comes from a run limited to other families
  (``--attn-only``);
- ``not in quick table``: the certificate comes from the quick table, which
  holds no case of the family (it samples the families; the full table has them
  for this manifest);
- ``declined in quick table``: the quick table's cases of the family were all
  declined by the backend's ``check()``; the full table's other cases may be
  served.

A quick certificate names the families the full table draws for its manifest
(``full_table_families``): a family outside them is ``unsupported`` in either
table. (Certificates written before that field read ``not in quick table``.)

Nothing here imports JAX or a backend: a matrix can be read anywhere the
certificates are.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .text import markdown_table, table

#: The folder ``make test`` writes its certificates to.
DEFAULT_FOLDER = ".certificates"
#: The lines that hold a matrix in a Markdown file (``matrix --into FILE``).
MATRIX_BEGIN = "<!-- attn-backends matrix: begin -->"
MATRIX_END = "<!-- attn-backends matrix: end -->"
#: Families that test refusals of what the manifest does not claim, with the
#: family they refuse within (None: the dense call): with everything claimed
#: there is nothing to refuse, and their one test skips; without paged support
#: at all, paged refusals do not apply (unsupported).
REFUSALS = {"unclaimed": None, "paged_unclaimed": "paged"}
#: Fields a file must hold to be read as a certificate.
REQUIRED = ("backend", "backend_version", "jax", "platform", "mode", "passed", "families")

LEGEND = (
    "pass: every test of the family passed (N skipped: the backend declared those "
    "unsupported); FAIL F/N: F of its N tests failed; unsupported: the backend declares "
    "it does not serve what the family tests (its manifest claims none of it, or its "
    "check() declines every case), so none ran; not run: the certificate comes from a "
    "run of other families only (--attn-only); not in quick table: the quick table "
    "holds no case of the family (the full table does, for this manifest); declined in "
    "quick table: check() declined the quick table's cases of it (the full table has "
    "more); nothing to refuse: the manifest claims "
    "everything a refusal family (unclaimed) checks is refused, so it had nothing to check."
)


@dataclass(frozen=True)
class Certified:
    """One certificate file, read: ``label`` names its column of the matrix."""

    path: str
    data: dict[str, Any]
    label: str = ""

    @property
    def jax_line(self) -> str:
        """``0.12`` for jax ``0.12.0.1``: the line the suite ran on."""
        return ".".join(str(self.data["jax"]).split(".")[:2])


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def _files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise ValueError(
                    f"no certificate (*.json) in {given}: write some with `attn-backends check "
                    f"NAME --json {given}/NAME.json` (make test writes them to {DEFAULT_FOLDER})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(
                f"{given} is neither a certificate file nor a folder of them: give the JSON "
                f"files `attn-backends check NAME --json FILE` wrote (default: the folder "
                f"{DEFAULT_FOLDER}, where make test writes them)")
    return files


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as a certificate: {exc}") from exc
    missing = [f for f in REQUIRED if not isinstance(data, dict) or f not in data]
    if missing:
        raise ValueError(
            f"{path} is not a certificate of attn-backends check: it has no "
            f"{', '.join(map(repr, missing))} (expected the JSON that `attn-backends check NAME "
            "--json FILE` writes)")
    return data


def _base_label(cert: Certified) -> str:
    label = f"{cert.data['backend']} {cert.jax_line}"
    return label if cert.data["platform"] == "cpu" else f"{label} {cert.data['platform']}"


def load(paths: Sequence[str]) -> list[Certified]:
    """The certificates in ``paths`` (files, or folders of ``*.json``), one column each,
    ordered by library, backend, jax version and platform; each labelled
    ``backend jax-line`` (with the platform when not cpu, the table when two share
    that, numbered when they share that too)."""
    read = [Certified(str(p), _read(p)) for p in _files(paths)]
    read.sort(key=lambda c: (str(c.data.get("distribution") or ""), c.data["backend"],
                             _version_key(str(c.data["jax"])), c.data["platform"],
                             str(c.data.get("date", ""))))
    shared = Counter(_base_label(c) for c in read)
    labels = [_base_label(c) + (f" {_run(c.data)}" if shared[_base_label(c)] > 1 else "")
              for c in read]
    seen: Counter[str] = Counter()
    out: list[Certified] = []
    for cert, label in zip(read, labels, strict=True):
        seen[label] += 1
        if labels.count(label) > 1:
            label += f" ({seen[label]})"
        out.append(Certified(cert.path, cert.data, label))
    return out


def cell(certificate: dict[str, Any], family: str) -> str:
    """What ``certificate`` says of ``family``: pass, FAIL F/N, unsupported, nothing to
    refuse, not run, not in quick table or declined in quick table."""
    only = certificate.get("only_families")
    if only and family not in only:
        return "not run"
    quick = certificate.get("mode") == "quick"
    full_table = certificate.get("full_table_families")
    # The quick table samples the families: one it holds no case of, or whose
    # cases it holds check() declined, says nothing of what the backend serves,
    # unless the full table has no case of it for this manifest either.
    sampled_out = quick and (full_table is None or family in full_table)
    if family not in certificate["families"] and quick:
        return "not in quick table" if sampled_out else "unsupported"
    by_dtype = certificate["families"].get(family, {})
    counts = {k: sum(int(c.get(k, 0)) for c in by_dtype.values())
              for k in ("passed", "failed", "skipped")}
    if counts["failed"]:
        return f"FAIL {counts['failed']}/{sum(counts.values())}"
    if not counts["passed"]:
        if quick and full_table is not None and family in full_table:
            return "declined in quick table"
        if family not in REFUSALS:
            return "unsupported"
        within = REFUSALS[family]
        served = within is None or cell(certificate, within) != "unsupported"
        return "nothing to refuse" if served else "unsupported"
    return "pass" + (f" ({counts['skipped']} skipped)" if counts["skipped"] else "")


def _verdict(data: dict[str, Any]) -> str:
    cases = data.get("cases", {})
    tests = data.get("tests", {})
    word = "PASSED" if data["passed"] else "FAILED"
    failed = f", {tests.get('failed')} failed" if tests.get("failed") else ""
    return f"{word}: {cases.get('passed', '?')}/{cases.get('run', '?')} cases{failed}"


def _run(data: dict[str, Any]) -> str:
    only = data.get("only_families")
    return str(data["mode"]) + (f", only {','.join(only)}" if only else "")


def tables(certified: Sequence[Certified]) -> tuple[tuple[list[str], list[list[str]]], ...]:
    """(header, rows) of the certificates table and of the family matrix."""
    header = ["column", "library", "backend", "version", "jax", "jaxlib", "platform", "table",
              "verdict", "date"]
    rows = [[c.label, str(c.data.get("distribution") or "-"), c.data["backend"],
             str(c.data["backend_version"]), str(c.data["jax"]), str(c.data.get("jaxlib", "-")),
             f"{c.data['platform']} ({c.data.get('device_kind', '?')})", _run(c.data),
             _verdict(c.data), str(c.data.get("date", "-"))[:10]] for c in certified]
    families = sorted({f for c in certified for f in c.data["families"]})
    matrix = [[family] + [cell(c.data, family) for c in certified] for family in families]
    return (header, rows), (["family"] + [c.label for c in certified], matrix)


def render(certified: Sequence[Certified], *, markdown: bool = False) -> str:
    """The certificates table, the family matrix and the legend, as text or Markdown."""
    (head, rows), (matrix_head, matrix) = tables(certified)
    if markdown:
        return "\n\n".join([markdown_table(rows, head), markdown_table(matrix, matrix_head),
                            LEGEND])
    return "\n\n".join([f"certificates\n\n{table(rows, head)}",
                        f"contract families\n\n{table(matrix, matrix_head)}", LEGEND])


def write_into(path: str, text: str) -> None:
    """Replace what lies between the lines MATRIX_BEGIN and MATRIX_END of the file
    ``path`` with ``text``; the rest of the file is kept as it is."""
    try:
        lines = Path(path).read_text().split("\n")
    except OSError as exc:
        raise ValueError(f"--into {path}: cannot read it ({exc})") from exc
    found = [i for i, line in enumerate(lines) if line.strip() in (MATRIX_BEGIN, MATRIX_END)]
    marks = [lines[i].strip() for i in found]
    if marks != [MATRIX_BEGIN, MATRIX_END]:
        raise ValueError(
            f"--into {path}: expected one line '{MATRIX_BEGIN}' followed by one line "
            f"'{MATRIX_END}', found {marks or 'neither'}; add them where the matrix goes")
    begin, end = found
    lines[begin + 1:end] = ["", text, ""]
    Path(path).write_text("\n".join(lines))


def cmd_matrix(paths: Sequence[str], *, markdown: bool, into: str | None = None) -> int:
    """Print the matrix of the certificates in ``paths`` (default: :data:`DEFAULT_FOLDER`),
    or, with ``into``, write it as Markdown into that file (:func:`write_into`)."""
    certified = load(list(paths) or [DEFAULT_FOLDER])
    if into is None:
        print(render(certified, markdown=markdown))
    else:
        write_into(into, render(certified, markdown=True))
        print(f"wrote the matrix of {len(certified)} certificates into {into}")
    return 0
