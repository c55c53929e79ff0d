"""benchmarks/bench_paged.py's quick mode: its JSON result has every part, with
positive times, bandwidth fractions, ratios to the peers and one temporary-memory
row per pool size (structure only: timings on a shared CPU are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_paged.py"


def test_quick_run_reports_decode_mixed_and_memory():
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    decode, mixed, memory = result["decode"], result["mixed"], result["memory"]
    ceilings = ("einsum_ceiling", "einsum_ceiling_heads_first")
    for name in ("sum", "paged", "contiguous", *ceilings):
        assert decode[name]["median_ms"] > 0 and decode[name]["timed_runs"] == 2
    assert decode["sum"]["gb_per_s"] > 0
    for name in ("paged", "contiguous", *ceilings):
        assert decode[name]["bandwidth_fraction"] > 0
    assert decode["paged_speed_vs_contiguous"] == (
        decode["contiguous"]["median_ms"] / decode["paged"]["median_ms"])
    assert decode["live_bytes"] == 2 * sum(result["lengths"]) * 2 * 16 * 4
    assert mixed["paged"]["median_ms"] > 0 and mixed["dense_two_calls"]["median_ms"] > 0
    assert (mixed["prefill_rows"], mixed["decode_rows"]) == (24, 3)
    assert [row["num_pages"] for row in memory] == [result["num_pages"] * f for f in (1, 2, 4, 8)]
    assert all(row["temp_bytes"] > 0 for row in memory)
