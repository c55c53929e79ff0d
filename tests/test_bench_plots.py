"""The benchmark scripts draw their figures from their runs' JSON: each report
writes PNGs (checked by their signature and size) from a small run's results,
and BENCHMARKS.md shows only pictures that exist."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _docs import ROOT
from _terminal import stderr_of

PNG = b"\x89PNG\r\n\x1a\n"
RUN = {"machine": "a test", "date": "2026-12-08"}


def _report(script: str, files: list[Path], folder: Path) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--report",
                           *map(str, files), "--plot", str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_the_gemma3_wall_report_draws_its_two_figures(tmp_path: Path) -> None:
    files = []
    for runtime, dtype, rate in (("ours", "float32", 30.0), ("llama_cpp", "Q4_K_M", 80.0)):
        cases = {name: {"seconds": 1.0, "tokens_per_s": rate, "new_tokens": 8, "prompts": 2,
                        "prompt_tokens": [64, 64], "max_new_tokens": 8}
                 for name in ("short", "long", "batch16", "ttft128", "ttft2048")}
        files.append(tmp_path / f"{runtime}.json")
        files[-1].write_text(json.dumps({"runtime": runtime, "dtype": dtype, "cases": cases,
                                         "run": RUN}))
    table = _report("bench_gemma3_wall.py", files, tmp_path / "plots")
    assert "| short | 30.0 tok/s" in table
    assert all(_is_png(tmp_path / "plots" / n)
               for n in ("gemma3_tokens_per_s.png", "gemma3_ttft.png"))


def test_the_lengths_report_draws_its_two_figures(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_lengths import KV_LENS, SEQS, TORCH

    def rows(name: str, scale: float) -> dict:
        return {"run": RUN,
                "dense": [{"backend": name, "seq": s, "kind": kind, "ms": scale * s / 256}
                          for s in SEQS for kind in ("fwd", "fwd+bwd")],
                "decode": [{"backend": name, "kv_len": t, "ms": scale * t / 1024}
                           for t in KV_LENS]}

    files = [tmp_path / "ours.json", tmp_path / "torch.json"]
    files[0].write_text(json.dumps(rows("native_cpu", 1.0)))
    files[1].write_text(json.dumps(rows(TORCH, 2.0)))
    table = _report("bench_lengths.py", files, tmp_path / "plots")
    assert "| 256 | 1 | 2 | 2.00x |" in table  # torch's time over the fastest of ours
    assert all(_is_png(tmp_path / "plots" / n)
               for n in ("dense_time_vs_length.png", "decode_time_vs_context.png"))


def test_benchmarks_md_shows_only_pictures_that_exist() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) >= 4, images
    missing = [i for i in images if not (ROOT / i).is_file()]
    assert not missing, missing


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "redirected"])
def test_the_scripts_progress_shows_in_a_terminal_only(terminal: bool) -> None:
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
              "from plotting import progress\n"
              "for row in progress(range(3), desc='rows'):\n"
              "    print('| row', row, '|')\n")
    err = stderr_of([sys.executable, "-c", script], terminal=terminal)
    if terminal:
        assert "rows: 100%" in err and "3/3" in err, err
    else:
        assert err == "", err
