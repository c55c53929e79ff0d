"""Many hosts, local work (docs/MANY_CHIPS.md, "Local work"): process 0 alone makes
calls of new signatures on its own devices while the other waits at a barrier,
and each is served at once, as on one host; the calls every process makes
before and after still agree. Real processes on 127.0.0.1 (jax.distributed over
gloo, 2 cpu devices each, the default registry with probes on)."""

from __future__ import annotations

import pytest

from multihost._launch import one_choice, run, single_process_choice

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=45)

TOLERANCE = 1e-5
#: Without local work chosen locally each of process 0's calls would wait this
#: long for process 1's offer and raise AgreementError (the teeth:
#: tests/core/test_local_work.py).
AGREE = {"ATTN_BACKENDS_AGREE_TIMEOUT_S": "30"}
#: What process 0 alone calls, each served in under 10 s.
LOCAL_CALLS = {"eager", "eager grad", "jit grad", "get_paged", "paged"}


def test_process_0_alone_is_served_its_local_work_while_the_other_waits(tmp_path):
    results, _ = run(tmp_path, 2, "local", env=[AGREE, AGREE])
    # Before and after process 0's local work, every process agrees.
    assert one_choice(results) == single_process_choice()
    for r in results:
        assert set(r["chosen"]) == {"plain", "jit grad"}
        assert max(r["worst"].values()) < TOLERANCE, r["worst"]
    first = results[0]
    assert set(first["seconds"]) == LOCAL_CALLS and max(first["seconds"].values()) < 10, \
        first["seconds"]
    assert set(first["local"]) == {"eager", "eager grad", "jit grad", "paged"}
    assert max(first["local"].values()) < TOLERANCE, first["local"]
    assert "hosts: local work, not agreed" in first["local explain"]
    for name, error in first["refused"].items():
        assert error is not None, f"a {name} call marked local that spans processes was served"
        kind, message = error
        assert kind == "UnsupportedError", error
        assert "is local work (marked by attn_backends.local_work()), but it spans processes" \
            in message, message
    assert "devices of process(es) [1]" in first["refused"]["eager"][1]
    assert "the mesh in context (jax.sharding.set_mesh) holds devices of process(es) [1]" \
        in first["refused"]["jit"][1]
