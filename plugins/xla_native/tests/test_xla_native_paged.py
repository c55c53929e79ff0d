"""xla_native's paged attention (docs/DESIGN.md, "Paged attention"): the shared
case set against the float64 oracle (tests/_paged_support.py's
:class:`PagedCases`) with blocks of 2 pages, so sequences cross several blocks
and a block several pages, with tiles of 2 rows, so prefill chunks span several
tiles, in groups of 2 and 3 tiles (several groups of each kind of tile, decode
steps far shorter than a chunk beside them); selection on cpu; and temporary
memory that does not grow with the pool. Its defaults run the suite's paged
family in ``make test``'s certification of xla_native, on both jax lines.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _docs import code_blocks
from _paged_support import PS, PagedCases, paged_case
from attn_backend_xla_native import PagedConfig
from attn_backends.oracle import paged_attention as oracle

SERVING_GUIDE = "docs/guides/serving.md"


class TestXlaNativePagedSmallBlocks(PagedCases):
    backend = "xla_native"
    layout = "heads_first"
    options = PagedConfig(pages_per_block=2)


class TestXlaNativePagedGroupsOfTwo(PagedCases):
    """Groups of 2 tiles of 2 rows: every prefill chunk of the case set spans
    several tiles, most ending in a partial one, and a batch with more than two
    tiles of a kind runs several groups of it, many ending in a partial one."""

    backend = "xla_native"
    layout = "heads_first"
    options = PagedConfig(pages_per_block=2, rows_per_tile=2, tiles_per_group=2)

    def test_decode_steps_far_shorter_than_the_chunk(self) -> None:
        # A 23-row chunk (12 tiles, 6 groups) of a 170-key sequence (22 blocks),
        # a 3-row chunk, and 7 decode steps of 1 to 40 keys in no order of length
        # (4 groups, the last partial, each running its own few blocks).
        seqs = [(1, 9), (23, 170), (1, 1), (1, 40), (3, 30), (1, 5), (1, 33), (1, 2), (1, 17)]
        self.agrees(seqs, pad_rows=3, spare_pages=2)
        self.agrees(seqs, call=dict(window=(6, None)))

    def test_short_chunks_each_ending_in_a_partial_tile(self) -> None:
        # 17 rows, no padding, in 10 chunk tiles: more than 17 / 2 rounded up, as
        # many as a batch of chunks may need.
        self.agrees([(3, 7), (2, 9), (3, 3), (1, 4), (5, 12), (3, 20)], pad_rows=0)


class TestXlaNativePagedDecodeOnlyGroups(PagedCases):
    """``max_q_len=1`` (only the decode kind compiled) in groups of 3 tiles."""

    backend = "xla_native"
    layout = "heads_first"
    options = PagedConfig(pages_per_block=2, tiles_per_group=3)
    max_q_len = 1


def test_cpu_selection_picks_xla_native_over_reference():
    registry = ab.Registry(only=["xla_native", "reference"])
    paged = registry.get_paged(device="cpu", num_q_heads=8, num_kv_heads=2, head_dim=16,
                               page_size=16, dtype="bfloat16", softcap=30.0, window=(64, None))
    assert paged.backend.name == "xla_native"
    verdicts = {v.backend: v for v in paged.explain().verdicts}
    assert "reference" in verdicts


def test_the_paged_config_is_checked():
    with pytest.raises(ValueError, match="pages_per_block must be an int >= 1, got 0"):
        PagedConfig(pages_per_block=0)
    with pytest.raises(ValueError, match="rows_per_tile must be an int >= 1, got True"):
        PagedConfig(pages_per_block=1, rows_per_tile=True)
    with pytest.raises(ValueError, match="tiles_per_group must be an int >= 1, got 0"):
        PagedConfig(pages_per_block=1, tiles_per_group=0)


def _temp_bytes(num_pages: int) -> int:
    """Compile (never run) a decode step of 8 sequences on a pool of ``num_pages``."""
    paged = ab.registry.get_paged(backend="xla_native", num_q_heads=8, num_kv_heads=2,
                                  head_dim=64, page_size=16, dtype="float32")
    pool = jax.ShapeDtypeStruct((num_pages, 16, 2, 64), jnp.float32)
    cache = jax.eval_shape(paged.from_canonical, pool, pool)
    i32 = jnp.int32
    batch = ab.PagedBatch(jax.ShapeDtypeStruct((9,), i32), jax.ShapeDtypeStruct((8,), i32),
                          jax.ShapeDtypeStruct((8, 32), i32), jax.ShapeDtypeStruct((), i32))
    q = jax.ShapeDtypeStruct((8, 8, 64), jnp.float32)
    compiled = jax.jit(paged.__call__).lower(q, cache, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temporary_memory_does_not_grow_with_the_pool():
    small, large = _temp_bytes(64), _temp_bytes(1024)
    assert small == large
    # No copy of the pool: far below the 1024-page pool's K alone (its rows' blocks
    # of K and V, 8 rows * 128 keys each, are about 1 MiB).
    assert large < 1024 * 16 * 2 * 64 * 4 // 4


def test_the_serving_guides_example_runs_on_xla_native_and_agrees_with_the_oracle():
    # the first cell of docs/guides/serving.md, as the site shows it
    code = code_blocks(SERVING_GUIDE)[0].replace("print(", "str(")
    scope: dict = {}
    # The example asks the registry for its choice; here xla_native serves it.
    code = code.replace("registry.get_paged(", 'registry.get_paged(backend="xla_native", ')
    exec(compile(code, f"{SERVING_GUIDE} (paged)", "exec"), scope)
    k_pages, v_pages = scope["paged"].to_canonical(scope["cache"])
    expected = oracle(scope["q"], k_pages, v_pages, *scope["batch"])
    np.testing.assert_allclose(np.asarray(scope["out"]), expected, atol=PagedCases.atol, rtol=0)
    assert scope["paged"].backend.name == "xla_native"


def test_a_long_sequence_crosses_many_blocks_in_a_mixed_step():
    """Blocks of 3 pages over sequences of up to 11 blocks, next to a decode step."""
    paged = ab.registry.get_paged(backend="xla_native", backend_options={
        "xla_native": PagedConfig(pages_per_block=3)}, num_q_heads=4, num_kv_heads=2,
        head_dim=8, page_size=PS, dtype="float32", window=(37, None))
    case = paged_case([(40, 130), (1, 77), (7, 7)], page_size=PS, pad_rows=2)
    cache = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    out = np.asarray(jax.jit(paged.__call__)(jnp.asarray(case.q), cache, case.batch()))
    np.testing.assert_allclose(out, case.expected(window=(37, None)), atol=PagedCases.atol,
                               rtol=0)
