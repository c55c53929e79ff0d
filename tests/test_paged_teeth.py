"""The paged family and the paged probe have teeth: mutants of xla_native's paged
kernel (and of core's heads_first write, which xla_native, flash_triton and
flash_pallas' decode path use) fail ``attn-backends check xla_native`` and the
paged probe; the unmutated code passes both.

Each mutant is one small source edit of one function, applied in a fresh
subprocess before anything calls it (the function is recompiled from its edited
source into its own module, so classes keep their identity). Every edit must
match the function's source exactly once, so a refactor fails these tests loudly
(update the edit) instead of leaving a mutant that changes nothing. To bound CI
time each check runs the paged family's cases that reach the bug (``-k``) and
stops at the first failure; that the unmutated backend passes the whole family
is what ``make test``'s ``attn-backends check xla_native`` certifies, and each
run here of the same selection unmutated passes too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=41)

pytest.importorskip("attn_backend_xla_native")

_LAUNCHER = r"""
import importlib, inspect, json, os, sys
for module, function, old, new in json.loads(os.environ["ATTN_TEETH_EDITS"]):
    mod = importlib.import_module(module)
    src = inspect.getsource(getattr(mod, function))
    if src.count(old) != 1:
        print(f"MUTANT-STALE: {module}.{function} holds {src.count(old)} copies of {old!r}")
        sys.exit(97)
    code = compile("from __future__ import annotations\n" + src.replace(old, new),
                   mod.__file__, "exec")
    exec(code, mod.__dict__)
"""
_CHECK = _LAUNCHER + r"""
from attn_backends_cli.main import main
sys.exit(main(sys.argv[1:]))
"""
_PROBE = _LAUNCHER + r"""
import attn_backends as ab
from attn_backends.contract.paged_bind import bind_paged
from attn_backends.probe.paged_run import run_paged_probe
backend = ab.Registry(probe=None, only=["xla_native"]).backend("xla_native")
call = bind_paged(num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32",
                  window=(3, None), softcap=20.0,
                  kv_dtype=os.environ.get("ATTN_TEETH_CACHE_DTYPE") or None)
print("REASONS " + json.dumps(run_paged_probe(backend, call, "cpu")))
"""

_KERNEL = "attn_backend_xla_native._paged"
# name -> (edits [(module, function, old, new)], the family's cases that reach it
# (-k), a fragment of the failing case's id, how the probe's reason starts).
MUTANTS = {
    "page_table_off_by_one_page": (
        [(_KERNEL, "_attend", "jnp.clip(batch.page_table[tiles.seq[:, None], cols[None, :]], 0",
          "jnp.clip(batch.page_table[tiles.seq[:, None], cols[None, :]] + 1, 0")],
        "test_paged_matches_oracle and paged-mixed-float32", "paged-mixed-",
        "probe: out "),
    "last_partial_page_dropped": (
        [(_KERNEL, "_attend", "filled = (pos[None, :] < kv_len[:, None]) &",
          "filled = (pos[None, :] < kv_len[:, None] // call.page_size * call.page_size) &")],
        "test_paged_matches_oracle and paged-kv5-float32", "paged-kv5-",
        "probe: out "),
    "window_off_by_one": (
        [(_KERNEL, "_attend", "visible &= pos >= first[..., None]",
          "visible &= pos >= first[..., None] - 1")],
        "test_paged_matches_oracle and paged-window-p-float32", "paged-window-p-",
        "probe: out "),
    "last_group_skipped": (
        [(_KERNEL, "_run", "lax.fori_loop(0, -(-tiles.count // width), one_group, out)",
          "lax.fori_loop(0, tiles.count // width, one_group, out)")],
        # One decode step beside a chunk: a partial last group for any group size.
        "test_paged_matches_oracle and paged-kv5-float32", "paged-kv5-",
        "probe: out "),
    "padding_slot_written": (
        # Negative slots wrap around in .at[]: the padding token lands in the last slots.
        [("attn_backends.contract.heads_first", "write",
          "where = jnp.where(slots < 0, flat, slots)", "where = slots")],
        "test_paged_write and paged-store-float32", "paged-store-float32",
        "probe: write changed K"),
    # A quantized cache (the quantized family; the probe on an int8 cache).
    "value_scale_forgotten": (
        [(_KERNEL, "_attend", "for x, s in zip((keys, values), scales, strict=True))",
          "for x, s in zip((keys, values), (scales[0], scales[1] * 0 + 1), strict=True))")],
        "test_paged_matches_oracle and quantized-mixed-float32-int8", "quantized-mixed-",
        "probe: out "),
    "neighbours_scale": (
        [(_KERNEL, "_attend", "dequantize(x, s[:, pages].reshape(heads, count, block_keys), wide)",
          "dequantize(x, jnp.roll(s[:, pages].reshape(heads, count, block_keys), 1, -1), wide)")],
        "test_paged_matches_oracle and quantized-mixed-float32-int8", "quantized-mixed-",
        "probe: out "),
    "values_read_unsigned": (
        [(_KERNEL, "_attend", "dequantize(x, s[:, pages]",
          "dequantize(lax.bitcast_convert_type(x, jnp.uint8), s[:, pages]")],
        "test_paged_matches_oracle and quantized-mixed-float32-int8", "quantized-mixed-",
        "probe: out "),
    "quantized_write_drops_tokens": (
        # The pool already holding the suite's copy of a token must not hide it.
        [("attn_backends.contract.heads_first", "write",
          "(k, k_scale), (v, v_scale) = (quantize(x, call.kv_dtype) for x in (k, v))",
          "(k, k_scale), (v, v_scale) = (quantize(x, call.kv_dtype) for x in (k, v))\n"
          "        where = jnp.where(jnp.arange(where.shape[0]) < 4, where, flat)")],
        "test_paged_write and quantized-store-float32-int8", "quantized-store-float32-int8",
        "probe: write quantized K wrong"),
    "quantizer_scale_without_largest": (
        # Every element stays within its (coarser) half step: only the scale's rule
        # tells this quantizer from the contract's.
        [("attn_backends.contract.paged_quantize", "quantize",
          "scale = jnp.where(finite, peak * jnp.float32(1.0 / largest), jnp.nan)",
          "scale = jnp.where(finite, peak, jnp.nan)")],
        "test_paged_write and quantized-store-float32-int8", "quantized-store-float32-int8",
        "probe: write quantized K wrong: scales"),
    "quantizer_rounds_down": (
        [("attn_backends.contract.paged_quantize", "quantize", "ratio = jnp.round(ratio)",
          "ratio = jnp.floor(ratio)")],
        "test_paged_write and quantized-store-float32-int8", "quantized-store-float32-int8",
        "probe: write quantized K wrong"),
}
#: The mutants of the quantized path, probed on an int8 cache.
_QUANTIZED = ("value_scale_forgotten", "neighbours_scale", "values_read_unsigned",
              "quantized_write_drops_tokens", "quantizer_scale_without_largest",
              "quantizer_rounds_down")
_EVERY_SELECTION = " or ".join(f"({m[1]})" for m in MUTANTS.values())


def _run(script: str, edits: list, args: list[str], tmp_path: Path,
         kv_dtype: str = "") -> tuple[int, str]:
    env = dict(os.environ, ATTN_TEETH_EDITS=json.dumps(edits),
               ATTN_BACKENDS_CACHE_DIR=str(tmp_path / "cache"), ATTN_TEETH_CACHE_DTYPE=kv_dtype)
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert "MUTANT-STALE" not in log, log[-2000:]
    return proc.returncode, log


def _check(edits: list, selection: str, tmp_path: Path) -> tuple[int, str, dict]:
    cert = tmp_path / "cert.json"
    code, log = _run(_CHECK, edits, ["check", "xla_native", "--json", str(cert), "--", "-x",
                                     "-q", "-p", "no:cacheprovider",
                                     "--attn-only=paged,quantized",
                                     "-k", selection], tmp_path)
    return code, log, json.loads(cert.read_text()) if cert.exists() else {}


def _probe(edits: list, tmp_path: Path, kv_dtype: str = "") -> list[str]:
    code, log = _run(_PROBE, edits, [], tmp_path, kv_dtype)
    assert code == 0, log[-3000:]
    line = next(x for x in log.splitlines() if x.startswith("REASONS "))
    return json.loads(line[len("REASONS "):])


def test_the_unmutated_code_passes_the_family_and_the_probe(tmp_path: Path) -> None:
    code, log, cert = _check([], _EVERY_SELECTION, tmp_path)
    assert code == 0 and cert["passed"], log[-3000:]
    # One case per distinct selection (two mutants may share one).
    assert cert["cases"]["passed"] == len({m[1] for m in MUTANTS.values()})
    assert _probe([], tmp_path) == []
    assert _probe([], tmp_path, "int8") == []


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_mutant_fails_the_family_and_the_probe(name: str, tmp_path: Path) -> None:
    edits, selection, fragment, says = MUTANTS[name]
    code, log, cert = _check(edits, selection, tmp_path)
    assert code == 1, f"{name}: check exited {code}, expected 1 (failures)\n{log[-3000:]}"
    failed = [f["case"] or f["test"] for f in cert.get("failures", [])]
    assert any(fragment in (c or "") for c in failed), (
        f"{name}: expected a failure in a {fragment!r} case, got {failed}\n{log[-2000:]}")
    reasons = _probe(edits, tmp_path, "int8" if name in _QUANTIZED else "")
    assert reasons, f"the paged probe passed the {name} mutant"
    assert all(r.startswith("probe") for r in reasons), reasons
    assert any(r.startswith(says) for r in reasons), reasons
