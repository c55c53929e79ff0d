"""The reference backend's paged attention against the float64 oracle
(docs/DESIGN.md, "Paged attention"): every length class around a page, page
orders, garbage, batch shapes, GQA, softcap, window, write and the round trip.

The batch is traced (one jit per case), so what is checked is the vectorised
program a serving loop runs, not an eager special case.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import paged_case
from attn_backends.oracle import paged_attention as oracle

PS = 4
# float32 with exact (HIGHEST) matmuls from float32 inputs: far inside what
# the dense float32 row allows any backend.
ATOL = 2e-6


def _paged(**call):
    args = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=PS, dtype="float32")
    return ab.registry.get_paged(backend="reference", **{**args, **call})


def _run(paged, case):
    cache = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    return np.asarray(jax.jit(paged.__call__)(jnp.asarray(case.q), cache, case.batch()))


def _agrees(seqs, *, call=None, **case_args):
    """The reference on a case with garbage equals its zero-filled twin bitwise and
    the oracle within ATOL; padding rows are zeros."""
    call = call or {}
    hq, hkv = call.get("num_q_heads", 4), call.get("num_kv_heads", 2)
    paged = _paged(**call)
    dirty = paged_case(seqs, page_size=PS, hq=hq, hkv=hkv, **case_args)
    clean = paged_case(seqs, page_size=PS, hq=hq, hkv=hkv, garbage=False, **case_args)
    out = _run(paged, dirty)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, _run(paged, clean))
    expected = clean.expected(scale=paged.call.scale, softcap=paged.call.softcap,
                              window=paged.call.window)
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)
    assert not out[int(dirty.cu_q_lens[dirty.num_seqs]):].any()
    return out


@pytest.mark.parametrize("kv_len", [1, PS - 1, PS, PS + 1, 3 * PS + 2])
@pytest.mark.parametrize("kind", ["prefill", "chunk", "decode"])
def test_lengths_around_a_page(kv_len, kind):
    q_len = {"prefill": kv_len, "chunk": max(1, kv_len // 2), "decode": 1}[kind]
    _agrees([(q_len, kv_len)], pad_rows=1)


@pytest.mark.parametrize("order", ["random", "reversed", "shared"])
def test_page_orders(order):
    _agrees([(3, 11), (1, 7), (2, 11)], order=order, spare_pages=3)


def test_mixed_batch_in_any_order_with_uncounted_rows_and_empty_sequences():
    # prefill, decode, zero new tokens, chunk, decode; the last two table rows
    # are not counted (num_seqs=5) and hold garbage metadata.
    seqs = [(6, 6), (1, 9), (0, 5), (3, 10), (1, 1), (4, 4), (2, 8)]
    _agrees(seqs, num_seqs=5, pad_rows=3, extra_cols=2)


def test_no_counted_sequence_gives_zeros():
    _agrees([(2, 3), (1, 4)], num_seqs=0, pad_rows=4)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_gqa_and_mqa(heads):
    hq, hkv = heads
    _agrees([(3, 7), (1, 10)], call=dict(num_q_heads=hq, num_kv_heads=hkv))


@pytest.mark.parametrize("window", [0, 1, PS, 2 * PS + 1])
def test_window(window):
    _agrees([(5, 13), (1, 12), (9, 9)], call=dict(window=(window, None)))


def test_softcap_and_scale():
    _agrees([(5, 13), (1, 6)], call=dict(softcap=2.0, scale=0.9))


def test_the_same_sequence_at_two_positions_gives_the_same_answer():
    paged = _paged()
    case = paged_case([(2, 9), (1, 3), (2, 9)], page_size=PS, order="shared")
    case.q[3:5] = case.q[0:2]
    out = _run(paged, case)
    np.testing.assert_array_equal(out[:2], out[3:5])
    np.testing.assert_allclose(out, case.expected(), atol=ATOL, rtol=0)


def test_write_then_attend_and_write_exactness():
    """Prefill by writing every token, then a decode step writing its own key
    first: each token lands where its slot says, padding slots write nothing."""
    paged = _paged()
    case = paged_case([(3, 6), (1, 9)], page_size=PS, garbage=False)
    cache = paged.init_cache(case.k_pages.shape[0])
    pad = np.full(3, -1, np.int32)
    slots = np.concatenate([case.slots, pad])
    k = np.concatenate([case.k_rows, np.full((3, 2, 8), np.nan, np.float32)])
    v = np.concatenate([case.v_rows, np.full((3, 2, 8), np.inf, np.float32)])
    before = [np.asarray(x) for x in paged.to_canonical(cache)]  # donated below
    cache = jax.jit(paged.write, donate_argnums=0)(cache, jnp.asarray(k), jnp.asarray(v),
                                                   jnp.asarray(slots))
    after = paged.to_canonical(cache)
    for pool, want, old in zip(after, (case.k_pages, case.v_pages), before, strict=True):
        np.testing.assert_array_equal(np.asarray(pool), want)  # written exactly, pad never
        flat, old = np.asarray(pool).reshape(-1, 2, 8), np.asarray(old).reshape(-1, 2, 8)
        rest = np.setdiff1d(np.arange(flat.shape[0]), case.slots)
        np.testing.assert_array_equal(flat[rest], old[rest])
    out = np.asarray(jax.jit(paged.__call__)(jnp.asarray(case.q), cache, case.batch()))
    np.testing.assert_allclose(out, case.expected(), atol=ATOL, rtol=0)


def test_float64_under_x64_computes_in_float64():
    case = paged_case([(3, 7), (1, 10)], page_size=PS, pad_rows=1)
    with jax.enable_x64(True):
        paged = _paged(dtype="float64")
        cache = paged.from_canonical(*(jnp.asarray(x, jnp.float64)
                                       for x in (case.k_pages, case.v_pages)))
        out = jax.jit(paged.__call__)(jnp.asarray(case.q, jnp.float64), cache, case.batch())
        assert out.dtype == jnp.float64
        out = np.asarray(out)
    clean = paged_case([(3, 7), (1, 10)], page_size=PS, pad_rows=1, garbage=False)
    np.testing.assert_allclose(out, clean.expected(), atol=1e-12, rtol=0)


def test_layout_round_trip_is_exact():
    paged = _paged(dtype="bfloat16")
    case = paged_case([(2, 7)], page_size=PS)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in (case.k_pages, case.v_pages))
    cache = paged.from_canonical(k, v)
    assert cache.layout == ab.CANONICAL_LAYOUT
    back = paged.to_canonical(cache)
    for a, b in zip(back, (k, v), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_the_readme_example_runs_and_agrees_with_the_oracle():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = readme.split("## Serving: paged KV cache", 1)[1].split("```python\n", 1)[1]
    scope: dict = {}
    exec(compile(block.split("```", 1)[0].replace("print(", "str("), "README.md (paged)",
                 "exec"), scope)
    k_pages, v_pages = scope["paged"].to_canonical(scope["cache"])
    batch = scope["batch"]
    expected = oracle(scope["q"], k_pages, v_pages, *batch)
    np.testing.assert_allclose(np.asarray(scope["out"]), expected, atol=ATOL, rtol=0)
    assert scope["paged"].backend.name == "reference"
