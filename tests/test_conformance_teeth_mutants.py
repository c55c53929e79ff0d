"""The suite has teeth for tiled kernels: mutants of xla_native fail ``attn-backends check``.

Each mutant is one small source edit of the installed ``xla_native`` kernel,
the bugs a blockwise kernel really has (issue 14's table): applied in a
fresh subprocess before the kernel is imported, then the public CLI runs
``attn-backends check xla_native`` in that process. Every edit must match
the kernel's source exactly once, so a refactor of the kernel fails these
tests loudly (update the edit) instead of leaving a mutant that changes
nothing and "passes" for the wrong reason.

The first three bugs are caught by ``--quick``; the three that live between
tiles need the full table, whose ``-tiles`` twins (the backend's
``tile_small_options``) and ``long`` cases span several tiles. To bound CI
time each run is cut to the families that matter and stops at the first
failure (``-x``). That the unmutated kernel passes these same cases is what
``make test``'s full ``attn-backends check xla_native`` certifies; each
test here also asserts that a failure names a case of the kind its bug
breaks, so a mutant cannot fail for an unrelated reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=70)

pytest.importorskip("attn_backend_xla_native")

#: Kernel modules in import order: an edited module is re-executed before the
#: modules that import names from it are loaded.
_ORDER = ("_plan", "_tile", "_ranges", "_forward", "_backward", "_kernel")

_LAUNCHER = r"""
import importlib, json, os, sys
from pathlib import Path

edits = json.loads(os.environ["ATTN_TEETH_EDITS"])
order = json.loads(os.environ["ATTN_TEETH_ORDER"])
for module in order:
    mine = [(old, new) for m, old, new in edits if m == module]
    if not mine:
        continue
    later = [m for m in order[order.index(module) + 1:]
             if "attn_backend_xla_native." + m in sys.modules]
    assert not later, f"{later} imported before {module} was edited"
    mod = importlib.import_module("attn_backend_xla_native." + module)
    src = Path(mod.__file__).read_text()
    for old, new in mine:
        if src.count(old) != 1:
            print(f"MUTANT-STALE: {module} holds {src.count(old)} copies of {old!r}")
            sys.exit(97)
        src = src.replace(old, new)
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
from attn_backends_cli.main import main
sys.exit(main(sys.argv[1:]))
"""

# name -> (edits [(module, old, new)], quick?, extra check arguments, a case
# id fragment some failure must contain).
MUTANTS = {
    "causal_off_by_one": (
        [("_plan", "vis = _and(vis, k_pos <= diag)", "vis = _and(vis, k_pos <= diag + 1)")],
        True, ["--attn-only=causal"], "causal-",
    ),
    "softcap_dropped_in_backward": (
        [("_backward", "s_t, capped_t = logits_t(plan, k_tile, q_t_tile, bias, qi, kj)",
          "s_t, capped_t = logits_t(__import__('dataclasses').replace(plan, softcap=None), "
          "k_tile, q_t_tile, bias, qi, kj)")],
        True, ["--attn-only=softcap", "-k", "test_gradients"], "softcap-",
    ),
    "gqa_modulo_in_backward": (
        # Query head h reads kv head h % Hkv instead of h // group, in the
        # backward's block layout only (the forward reads q_block).
        [("_plan", "x = x.reshape(b, plan.n_q, bq, plan.kv_heads, plan.group, e)\n"
                   "    x = x.transpose(1, 0, 3, 4, 2, 5)",
          "x = x.reshape(b, plan.n_q, bq, plan.group, plan.kv_heads, e)\n"
          "    x = x.transpose(1, 0, 4, 3, 2, 5)"),
         ("_plan", "x = x.transpose(1, 0, 4, 2, 3, 5)", "x = x.transpose(1, 0, 4, 3, 2, 5)")],
        True, ["--attn-only=gqa", "-k", "test_gradients"], "gqa-",
    ),
    "rescale_dropped_in_forward": (
        [("_forward", "row_sum = alpha * row_sum + p.sum(axis=-1)",
          "row_sum = row_sum + p.sum(axis=-1)"),
         ("_forward", "acc = acc * alpha[..., None] + dot_nn(", "acc = acc + dot_nn(")],
        False, ["--attn-only=shapes,causal", "-k", "test_forward and tiles"], "-tiles",
    ),
    "dq_overwritten_across_key_blocks": (
        [("_backward", "dq_t_tile = lax.dynamic_index_in_dim(dq_t, qi, keepdims=False) + dot_nn(",
          "dq_t_tile = dot_nn(")],
        False, ["--attn-only=shapes,causal", "-k", "test_gradients and tiles"], "-tiles",
    ),
    "probabilities_rounded_to_bfloat16": (
        [("_forward", "dot_nn(p.astype(v_tile.dtype), v_tile)",
          "dot_nn(p.astype(jnp.bfloat16).astype(v_tile.dtype), v_tile)")],
        False, ["--attn-only=shapes,gqa", "-k", "test_forward and float32"], "float32",
    ),
    # Dropout (the suite's dropout family judges under the exposed keep-mask).
    "dropout_key_ignored": (
        [("_kernel", "seed = dropout_seed(operands.dropout_key)",
          "seed = dropout_seed(jax.random.PRNGKey(0))")],
        False, ["--attn-only=dropout", "-k", "test_dropout_matches_oracle"], "dropout-",
    ),
    "dropout_not_rescaled": (
        [("_forward", "return jnp.where(keep, p * inv, 0.0)", "return jnp.where(keep, p, 0.0)")],
        False, ["--attn-only=dropout", "-k", "test_dropout_matches_oracle"], "dropout-",
    ),
    "dropout_backward_draws_another_mask": (
        # The backward passes the tile's block indices the wrong way round.
        [("_backward", "tile_keep(plan, seed, qi, kj)", "tile_keep(plan, seed, kj, qi)")],
        False, ["--attn-only=dropout", "-k", "test_dropout_matches_oracle"], "dropout-",
    ),
}


def _check(edits: list, args: list[str], tmp_path: Path) -> tuple[int, str, dict]:
    cert = tmp_path / "cert.json"
    env = dict(os.environ, ATTN_TEETH_EDITS=json.dumps(edits),
               ATTN_TEETH_ORDER=json.dumps(_ORDER),
               ATTN_BACKENDS_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-c", _LAUNCHER, "check", "xla_native", "--json", str(cert), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert "MUTANT-STALE" not in log, log[-2000:]
    return proc.returncode, log, json.loads(cert.read_text()) if cert.exists() else {}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_of_xla_native_fails_check(name: str, tmp_path: Path) -> None:
    edits, quick, only, fragment = MUTANTS[name]
    args = (["--quick"] if quick else []) + ["--", "-x", "-q", "-p", "no:cacheprovider", *only]
    code, log, cert = _check(edits, args, tmp_path)
    assert code == 1, f"{name}: check exited {code}, expected 1 (failures)\n{log[-3000:]}"
    failed = [f["case"] or f["test"] for f in cert.get("failures", [])]
    assert any(fragment in (c or "") for c in failed), (
        f"{name}: expected a failure in a {fragment!r} case, got {failed}\n{log[-2000:]}"
    )

