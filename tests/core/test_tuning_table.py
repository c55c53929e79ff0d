"""Tuning tables (core/src/attn_backends/probe/tuning.py): the margin rule, ties,
bucketing, keys, voiding on a version or digest change, a table's round trip
through disk and two processes writing one table. No clock is read: timings
are written down."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from attn_backends import AttentionCall
from attn_backends.probe.tuning import (
    BUCKET_RULE,
    TableEntry,
    TableError,
    Timing,
    TuningTable,
    bucket,
    class_key,
    decide,
    lookup,
    shape_class,
)

ENV = {"platform": "cpu", "device_kind": "cpu", "jax": "0.12.0", "jaxlib": "0.12.0",
       "libtpu": None}
IDS = {"xla_native": {"version": "1.0", "backend": "aaa", "core": "ccc"},
       "example_dense": {"version": "0.3", "backend": "bbb", "core": "ccc"}}


def call(batch: int = 8, q_len: int = 128, kv_len: int = 128, **kw) -> AttentionCall:
    return AttentionCall(batch=batch, q_len=q_len, kv_len=kv_len, q_heads=8, kv_heads=2,
                         head_dim=64, v_head_dim=64, dtype="float32", scale=0.125,
                         causal=True, **kw)


def timing(median: float, spread: float = 0.0) -> Timing:
    return Timing(median, spread, compile_s=1.0, rounds=5)


def entry(c: AttentionCall, winner: str = "example_dense", grad: bool = True,
          ids: dict | None = None) -> TableEntry:
    ids = IDS if ids is None else ids
    timing = {"median_s": 1.0, "spread_s": 0.01, "compile_s": 2.0, "rounds": 5}
    return TableEntry(shape_class(c, grad), default="xla_native", winner=winner, reason="measured",
                 margin=0.05, candidates={n: {**i, **timing} for n, i in ids.items()},
                 measured_at="2026-12-02T03:00:00Z")


class TestDecide:
    def test_a_faster_candidate_outside_the_spread_wins_with_its_ratio(self):
        winner, why = decide({"xla_native": timing(18.8e-3, 0.2e-3),
                              "example_dense": timing(14.3e-3, 0.2e-3)}, "xla_native")
        assert winner == "example_dense"
        assert why == "measured: 1.31x faster than xla_native"

    def test_faster_but_within_the_margin_keeps_the_priority_choice(self):
        winner, why = decide({"xla_native": timing(1.00), "example_dense": timing(0.96)},
                             "xla_native")
        assert winner == "xla_native" and "priority choice" in why

    def test_faster_by_the_margin_but_inside_the_spread_keeps_the_priority_choice(self):
        # 20% faster, but the spreads (0.15 each) overlap.
        winner, _ = decide({"xla_native": timing(1.0, 0.15), "example_dense": timing(0.8, 0.15)},
                           "xla_native")
        assert winner == "xla_native"
        winner, _ = decide({"xla_native": timing(1.0, 0.05), "example_dense": timing(0.8, 0.05)},
                           "xla_native")
        assert winner == "example_dense"

    def test_a_tie_keeps_the_priority_choice(self):
        assert decide({"a": timing(1.0), "b": timing(1.0)}, "a")[0] == "a"
        assert decide({"a": timing(1.0), "b": timing(1.0)}, "b")[0] == "b"

    def test_the_fastest_of_several_qualifying_candidates_wins(self):
        timings = {"p": timing(1.0), "a": timing(0.7), "b": timing(0.5), "c": timing(0.9)}
        assert decide(timings, "p") == ("b", "measured: 2.00x faster than p")

    def test_a_priority_choice_without_timing_is_refused(self):
        with pytest.raises(ValueError, match="priority choice 'p' has no timing"):
            decide({"a": timing(1.0)}, "p")


def test_timing_takes_the_median_and_median_absolute_deviation():
    t = Timing.of([3.0, 1.0, 2.0, 10.0, 2.5], compile_s=4.0)
    assert (t.median_s, t.spread_s, t.rounds, t.compile_s) == (2.5, 0.5, 5, 4.0)


class TestShapeClass:
    def test_bucketing_rounds_batch_and_lengths_up_to_powers_of_two(self):
        assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000, 1024, 1025)] == \
            [0, 1, 2, 4, 8, 8, 16, 1024, 1024, 2048]
        assert shape_class(call(5, 100, 1000), True) == shape_class(call(8, 128, 1024), True)
        assert shape_class(call(9, 128, 128), True) != shape_class(call(8, 128, 128), True)

    def test_static_features_and_the_pass_are_exact(self):
        base = call()
        assert class_key(shape_class(base, True)) != class_key(shape_class(base, False))
        for changed in (replace(base, dtype="bfloat16"), replace(base, causal=False),
                        replace(base, kv_heads=8), replace(base, head_dim=128, v_head_dim=128),
                        replace(base, window=(64, 0)), replace(base, softcap=30.0)):
            assert shape_class(changed, True) != shape_class(base, True)

    def test_the_platform_is_the_sections_not_the_keys(self):
        assert shape_class(replace(call(), platform="cpu"), True) == shape_class(call(), True)


class TestLookup:
    def table(self) -> TuningTable:
        table = TuningTable()
        table.add(ENV, entry(call()))
        return table

    def test_a_hit_names_the_winner_for_every_call_of_its_class(self):
        found = lookup(self.table(), call(6, 100, 120), True, ENV, IDS.get)
        assert found.winner == "example_dense" and not found.void
        assert found.note(self.table()).endswith("tuning table, 2026-12-02T03:00:00Z")

    def test_another_class_or_pass_is_a_silent_miss(self):
        for c, grad in ((call(16), True), (call(), False)):
            found = lookup(self.table(), c, grad, ENV, IDS.get)
            assert (found.entry, found.winner, found.void) == (None, None, ())

    @pytest.mark.parametrize("field", ["jax", "jaxlib", "libtpu", "device_kind"])
    def test_another_environment_voids_the_entry_with_the_difference(self, field):
        now = {**ENV, field: "9.9"}
        found = lookup(self.table(), call(), True, now, IDS.get)
        assert found.winner is None
        assert found.void == (f"measured in another environment: {field} {ENV[field]} then, "
                              "9.9 now",)

    @pytest.mark.parametrize("part", ["version", "backend", "core"])
    @pytest.mark.parametrize("name", ["xla_native", "example_dense"])
    def test_a_changed_version_or_digest_voids_the_entry(self, part, name):
        now = {**IDS, name: {**IDS[name], part: "changed"}}
        found = lookup(self.table(), call(), True, ENV, now.get)
        assert found.winner is None and found.entry is not None
        assert len(found.void) == 1 and found.void[0].startswith(f"{name}'s ")
        assert "changed now" in found.void[0]
        assert "void" in found.note(self.table())

    def test_an_uninstalled_winner_voids_the_entry(self):
        found = lookup(self.table(), call(), True, ENV, {"xla_native": IDS["xla_native"]}.get)
        assert found.winner is None and found.void == ("example_dense is not installed",)


class TestDisk:
    def test_round_trip_keeps_every_field_and_names_are_stored_not_positions(self, tmp_path):
        path = tmp_path / "table.json"
        table = TuningTable()
        table.add(ENV, entry(call()))
        table.add(ENV, entry(call(1, 1, 4096), winner="xla_native", grad=False))
        table.add({**ENV, "platform": "tpu", "device_kind": "TPU v5e"}, entry(call()))
        table.save(path)
        again = TuningTable.load(path)
        assert again.as_dict() == table.as_dict()
        data = json.loads(path.read_text())
        assert data["bucket_rule"] == BUCKET_RULE
        assert {e["winner"] for s in data["sections"] for e in s["entries"]} == \
            {"example_dense", "xla_native"}
        assert lookup(again, call(1, 1, 3000), False, ENV, IDS.get).winner == "xla_native"

    def test_saving_merges_with_what_is_on_disk_and_the_newer_entry_wins(self, tmp_path):
        path = tmp_path / "table.json"
        first, second = TuningTable(), TuningTable()
        first.add(ENV, entry(call(8)))
        first.add(ENV, entry(call(64)))
        second.add(ENV, entry(call(64), winner="xla_native"))
        first.save(path)
        merged = second.save(path)
        assert len(merged.sections[0].entries) == 2
        assert lookup(TuningTable.load(path), call(64), True, ENV, IDS.get).winner == "xla_native"
        assert lookup(TuningTable.load(path), call(8), True, ENV, IDS.get).winner == \
            "example_dense"

    @pytest.mark.parametrize("text, message", [
        ("not json", "not JSON"), ('{"format": 7}', "expected format 1, got 7"),
        ('{"format": 1, "bucket_rule": "linear"}', "bucketed by 'linear'"),
        ('{"format": 1, "bucket_rule": "pow2-v1", "sections": [{}]}', "malformed"),
    ])
    def test_a_bad_file_is_refused_naming_it_and_what_to_do(self, tmp_path, text, message):
        path = tmp_path / "t.json"
        path.write_text(text)
        with pytest.raises(TableError, match=message) as raised:
            TuningTable.load(path)
        assert str(path) in str(raised.value) and "attn-backends tune" in str(raised.value)

    def test_a_missing_file_names_the_setting(self, tmp_path):
        with pytest.raises(TableError, match="ATTN_BACKENDS_TUNING"):
            TuningTable.load(tmp_path / "nope.json")

    def test_two_processes_writing_one_table_keep_both_sets_of_entries(self, tmp_path):
        path = tmp_path / "shared.json"
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_tuning_table import ENV, call, entry
            from attn_backends.probe.tuning import TuningTable
            start = int(sys.argv[1])
            for batch in range(start, start + 20):
                table = TuningTable()
                table.add(ENV, entry(call(2 ** batch)))
                table.save({str(path)!r})
        """)
        writers = [subprocess.Popen([sys.executable, "-c", script, str(s)]) for s in (0, 20)]
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
        table = TuningTable.load(path)
        assert len(table.sections) == 1 and len(table.sections[0].entries) == 40
