"""`attn-backends tune` and `bench` show their progress (the call, the backend
last timed, the steps done) in a terminal, and no bar when stderr is
redirected, where tune prints only what it chose."""

from __future__ import annotations

import os
import sys

import pytest
from _terminal import stderr_of

CLI = "from attn_backends_cli.main import main; raise SystemExit(main())"


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "redirected"])
def test_tune_shows_progress_in_a_terminal_only(tmp_path, terminal):
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(tmp_path),
           "ATTN_BACKENDS_ONLY": "xla_native,reference"}
    err = stderr_of([sys.executable, "-c", CLI, "tune", "--device", "cpu", "--q", "1,32,2,16",
                     "--kv", "1,32,2,16", "--causal", "--warmup", "1", "--rounds", "2",
                     "--runs", "1", "--out", str(tmp_path / "table.json")],
                    terminal=terminal, env=env)
    assert "tuning table written to" in err, err
    # two candidates, each compiled once and timed in two rounds: 6 steps
    bar = "tune 1/1 q[1,32,2,16] kv[1,32,2,16/16] float32 causal"
    if terminal:
        assert bar in err and "6/6" in err and "100%" in err, err
    else:
        assert bar not in err and "\r" not in err, err


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "redirected"])
def test_bench_shows_progress_in_a_terminal_only(tmp_path, terminal):
    env = {**os.environ, "ATTN_BACKENDS_CACHE_DIR": str(tmp_path)}
    err = stderr_of([sys.executable, "-c", CLI, "bench", "--device", "cpu", "--seq", "64",
                     "--backends", "reference", "--reps", "1"], terminal=terminal, env=env)
    # one backend, one length, two passes, each compiled and then timed once: 4 runs
    if terminal:
        assert "bench: 100%" in err and "4/4" in err, err
    else:
        assert err == "", err
