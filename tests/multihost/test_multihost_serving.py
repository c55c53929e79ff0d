"""Many hosts (docs/MANY_CHIPS.md, "Many hosts"): every call kind served on every
process of a real multi-process run (127.0.0.1, jax.distributed over gloo, 2 cpu
devices each, the default registry with probes on), against the float64 oracle
and the single-process choice; and the command line on every process."""

from __future__ import annotations

import pytest

from multihost._launch import choices, run, run_cli, single_process_choice

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=155)

TOLERANCE = 1e-5


@pytest.mark.parametrize(("count", "shared"), [(2, False), (4, True)])
def test_every_process_serves_plain_sharded_ring_and_paged_calls(tmp_path, count, shared):
    results, _ = run(tmp_path, count, "serve", shared_cache=shared)
    # Each call is served by one backend on every process (the flax layer's
    # mask may send it to another than the plain call's).
    assert choices(results)["plain"] == single_process_choice()
    for r in results:
        assert set(r["worst"]) == {"plain", "sharded", "ring", "paged", "flax", "serving"}
        assert max(r["worst"].values()) < TOLERANCE, r["worst"]


def test_sharded_ring_and_paged_calls_with_no_mesh_context_on_every_process(tmp_path):
    # docs/MANY_CHIPS.md: arrays on a mesh over both processes, no set_mesh.
    results, _ = run(tmp_path, 2, "nocontext")
    for r in results:
        assert r["error"] is None, r.get("trace")
        assert set(r["worst"]) == {"plain", "sharded jit", "sharded eager", "ring jit",
                                   "ring eager", "paged"}
        assert max(r["worst"].values()) < TOLERANCE, r["worst"]
    assert choices(results)["sharded"] == single_process_choice()


def test_the_command_line_lists_explains_and_checks_on_every_process(tmp_path):
    call = ["--device", "cpu", "--q", "2,32,4,16", "--kv", "2,32,4,16", "--causal"]
    agreed = f"hosts: 2 processes agree on {single_process_choice()}"
    for args, seen in ((["list"], "xla_native"), (["explain", *call], agreed),
                       (["check", "reference", "--quick", "--", "-k", "decode"],
                        "conformance: PASSED")):
        for status, output in run_cli(tmp_path / args[0], 2, args):
            assert status == 0 and seen in output, output[-2000:]
