"""`attn-backends matrix`: the compatibility matrix read from certificates.

One real certificate (a quick check of the installed example_dense backend on
three families: a passing one, one it declares unsupported, the refusals),
and copies of it edited into the edge cases: a failing family, a family one
certificate lacks, the same backend on two jax lines.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jax
import pytest
from attn_backends_cli.main import main

#: The families of the real run: causal (claimed), paged (example_dense has no
#: paged support: the suite skips each test) and its refusals, unclaimed (its
#: refusals of the dense features it does not claim).
FAMILIES = "causal,paged,paged_unclaimed,unclaimed"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The certificate of ``attn-backends check example_dense --quick`` on FAMILIES."""
    pytest.importorskip("attn_backend_example_dense")
    folder = tmp_path_factory.mktemp("real")
    path = folder / "example_dense.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTN_BACKENDS_CACHE_DIR", str(folder / "cache"))
        code = main(["check", "example_dense", "--quick", "--json", str(path), "--",
                     f"--attn-only={FAMILIES}", "-q", "-p", "no:cacheprovider"])
    assert code == 0, path.read_text() if path.exists() else "no certificate written"
    return json.loads(path.read_text())


def _write(folder: Path, name: str, certificate: dict[str, Any]) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(certificate))
    return path


def _rows(text: str, title: str) -> list[list[str]]:
    """The rows (cells split at runs of two spaces) of the plain-text table ``title``."""
    block = text.split(f"{title}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in block if not line.startswith("-")]


def _matrix(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, list[str]]:
    """``attn-backends matrix ARGS`` as {"family" (header) or family: its cells}."""
    assert main(["matrix", *args]) == 0
    rows = _rows(capsys.readouterr().out, "contract families")
    return {row[0]: row[1:] for row in rows}


def test_a_real_certificate_reads_pass_unsupported_and_not_run(
        real: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "certs", "example_dense", real)
    assert main(["matrix", str(tmp_path / "certs")]) == 0
    out = capsys.readouterr().out
    [header, row] = _rows(out, "certificates")
    line = ".".join(jax.__version__.split(".")[:2])
    assert dict(zip(header, row, strict=True)) == {
        "column": f"example_dense {line}", "library": "attn-backend-example-dense",
        "backend": "example_dense", "version": real["backend_version"], "jax": jax.__version__,
        "jaxlib": real["jaxlib"], "platform": "cpu (cpu)",
        "table": f"quick, only {FAMILIES}",
        "verdict": f"PASSED: {real['cases']['passed']}/{real['cases']['run']} cases",
        "date": real["date"][:10]}
    cells = {r[0]: r[1:] for r in _rows(out, "contract families")}
    assert cells == {"family": [f"example_dense {line}"], "causal": ["pass"],
                     "paged": ["unsupported"], "paged_unclaimed": ["unsupported"],
                     "unclaimed": ["pass"]}


def test_failing_unsupported_and_two_jax_lines(real: dict[str, Any], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    older = copy.deepcopy(real)
    older.update(jax="0.10.2", jaxlib="0.10.2", passed=False)
    older["families"]["causal"] = {"float32": {"passed": 3, "failed": 1}}
    older["families"]["softcap"] = {"float32": {"passed": 2, "skipped": 1}}
    # A manifest that claims every dense feature: its refusal test skips.
    older["families"]["unclaimed"] = {"-": {"skipped": 1}}
    older["only_families"] = None
    folder = tmp_path / "certs"
    _write(folder, "example_dense", real)
    _write(folder, "example_dense-jax-0.10", older)
    cells = _matrix(capsys, str(folder))
    line = ".".join(jax.__version__.split(".")[:2])
    # Ordered by jax version: the 0.10 column first.
    assert cells["family"] == ["example_dense 0.10", f"example_dense {line}"]
    assert cells["causal"] == ["FAIL 1/4", "pass"]
    # Absent from the newer certificate, which ran other families only.
    assert cells["softcap"] == ["pass (1 skipped)", "not run"]
    assert cells["paged"] == ["unsupported", "unsupported"]
    assert cells["unclaimed"] == ["nothing to refuse", "pass"]
    # A full run that drew no case of a family (its manifest does not claim it)
    # beside one that ran it.
    del older["families"]["softcap"]
    older["mode"] = "full"
    softcap = {"float32": {"passed": 2}}
    _write(folder, "example_dense", {**real, "only_families": None,
                                     "families": {**real["families"], "softcap": softcap}})
    _write(folder, "example_dense-jax-0.10", older)
    assert _matrix(capsys, str(folder))["softcap"] == ["unsupported", "pass"]
    # The quick table samples the families: one it drew no case of is not a
    # declaration that the backend does not serve it (example_dense serves long
    # sequences; the quick table holds none)...
    assert "long" in real["full_table_families"] and "long" not in real["families"]
    long = {"float32": {"passed": 2}}
    _write(folder, "example_dense", {**real, "only_families": None, "mode": "full",
                                     "families": {**real["families"], "long": long,
                                                  "softcap": softcap}})
    _write(folder, "example_dense-jax-0.10", {**older, "mode": "quick"})
    assert _matrix(capsys, str(folder))["long"] == ["not in quick table", "pass"]
    # ... unless the full table draws no case of it for this manifest either:
    # example_dense does not claim softcap.
    assert "softcap" not in real["full_table_families"]
    assert _matrix(capsys, str(folder))["softcap"] == ["unsupported", "pass"]
    # A quick table whose cases of a claimed family check() all declined says
    # nothing of the full table's other cases.
    declined = {**older, "mode": "quick",
                "families": {**older["families"], "long": {"float32": {"skipped": 2}}}}
    _write(folder, "example_dense-jax-0.10", declined)
    assert _matrix(capsys, str(folder))["long"] == ["declined in quick table", "pass"]
    _write(folder, "example_dense-jax-0.10", {**declined, "mode": "full"})
    assert _matrix(capsys, str(folder))["long"] == ["unsupported", "pass"]
    # A certificate from before full_table_families: absent reads as not sampled.
    legacy = {k: v for k, v in older.items() if k != "full_table_families"}
    _write(folder, "example_dense-jax-0.10", {**legacy, "mode": "quick"})
    assert _matrix(capsys, str(folder))["softcap"] == ["not in quick table", "pass"]
    _write(folder, "example_dense", {**real, "only_families": None})
    # Two certificates of one backend on one line: named by their tables.
    _write(folder, "example_dense-full", {**real, "mode": "full", "only_families": None})
    assert _matrix(capsys, str(folder))["family"] == [
        "example_dense 0.10", f"example_dense {line} full", f"example_dense {line} quick"]


def test_markdown_holds_the_same_cells(real: dict[str, Any], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "example_dense", real)
    assert main(["matrix", "--markdown", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines
             if line.startswith("| ") and line.count("|") == 3)}
    assert rows["causal"] == ["pass"] and rows["paged"] == ["unsupported"]
    assert "| --- | --- |" in lines


@pytest.mark.parametrize("content, says", [
    (None, "is neither a certificate file nor a folder"),
    ("{not json", "cannot be read as a certificate"),
    (json.dumps({"backend": "x"}), "has no 'backend_version', 'jax'"),
])
def test_what_is_not_a_certificate_is_named(content: str | None, says: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    assert main(["matrix", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err


def test_an_empty_folder_says_how_to_make_certificates(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", str(tmp_path)]) == 2
    assert "attn-backends check NAME --json" in capsys.readouterr().err


def test_into_writes_the_markdown_between_the_markers_and_keeps_the_rest(
        real: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attn_backends_cli.matrix import MATRIX_BEGIN, MATRIX_END

    path = _write(tmp_path / "certs", "example_dense", real)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{MATRIX_BEGIN}\nstale table\n{MATRIX_END}\nafter\n")
    assert main(["matrix", str(path), "--into", str(readme)]) == 0
    assert "wrote the matrix of 1 certificates" in capsys.readouterr().out
    assert main(["matrix", "--markdown", str(path)]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    assert readme.read_text() == (f"# Title\n\nbefore\n{MATRIX_BEGIN}\n\n{printed}\n\n"
                                  f"{MATRIX_END}\nafter\n")
    # Again: the same file, nothing doubled.
    first = readme.read_text()
    assert main(["matrix", str(path), "--into", str(readme)]) == 0
    assert readme.read_text() == first
    readme.write_text("no markers\n")
    assert main(["matrix", str(path), "--into", str(readme)]) == 2
    assert "expected one line '<!-- attn-backends matrix: begin -->'" in capsys.readouterr().err
    assert readme.read_text() == "no markers\n"


def test_the_docs_matrix_is_the_commands_output() -> None:
    """docs/compatibility.md's block is what `matrix --into` writes: its two tables and the
    legend, every cell a word of the legend (a hand edit rarely is)."""
    from attn_backends_cli.matrix import LEGEND, MATRIX_BEGIN, MATRIX_END

    text = (Path(__file__).parents[1] / "docs" / "compatibility.md").read_text()
    block = text.split(MATRIX_BEGIN + "\n", 1)[1].split(MATRIX_END, 1)[0]
    tables = [part for part in block.strip().split("\n\n")]
    assert len(tables) == 3 and tables[2] == LEGEND
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in tables[1].splitlines()]
    words = re.compile(r"pass( \(\d+ skipped\))?|FAIL \d+/\d+|unsupported|nothing to refuse|"
                       r"not run|not in quick table|declined in quick table")
    assert rows[0][0] == "family" and len(rows) > 20
    for row in rows[2:]:
        assert all(words.fullmatch(c) for c in row[1:]), row
