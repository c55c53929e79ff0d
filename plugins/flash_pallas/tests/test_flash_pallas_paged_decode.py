"""flash_pallas' decode-only paged path (``_paged_decode.py``): JAX's TPU
``paged_attention`` kernel on the ``heads_first`` layout, for ``max_q_len=1``
bfloat16 calls.

Unlike the ragged kernel, this one runs in Pallas' TPU interpret mode, so the
shared case set (tests/_paged_support.PagedCases, decode versions of its cases)
runs the real kernel here, emulated on cpu, against the float64 oracle; the TPU
export shows the Mosaic kernel reading the cache as it lies.
"""

from __future__ import annotations

import dataclasses
import re

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import POOL, TPU, PagedCases, cache_sized_ops, paged_case
from attn_backend_flash_pallas import FlashPallasBackend, RaggedBlockSizes, _paged_decode
from attn_backends.probe.tolerances import tolerance

BF16 = tolerance("bfloat16", "out", platform="cpu")
DECODE = dict(page_size=16, head_dim=128, dtype="bfloat16", max_q_len=1)


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_PALLAS_INTERPRET", "1")


class TestFlashPallasPagedDecode(PagedCases):
    """The case set's decode versions in TPU interpret mode, 2 pages per compute
    block: its longest sequences (9 pages and more) cross several blocks."""

    backend = "flash_pallas"
    options = RaggedBlockSizes(kv_pages_per_block=2)
    page_size = 16
    head_dim = 128
    layout = "heads_first"
    float64 = False
    dtype = "bfloat16"
    max_q_len = 1
    # The oracle sees the same bfloat16 q, K and V: what is left is the output's
    # rounding to bfloat16 and float32 sums, which the bfloat16 row covers.
    atol, rtol = BF16.atol, BF16.rtol
    # JAX's paged_attention always starts at key 0: windowed decode calls go to
    # the ragged path (test_windowed_and_float32_decode_calls_take_the_ragged_layout).
    test_window = None

    @pytest.fixture(autouse=True)
    def _interpret(self, interpreted):
        pass

    @pytest.mark.parametrize("pool, bad", [("k_pages", np.inf), ("k_pages", 3e38),
                                           ("v_pages", np.inf), ("v_pages", np.nan)])
    def test_inf_and_huge_garbage_in_k_or_v_alone_never_matter(self, pool, bad):
        # The case set's NaN garbage sits in K and V alike; here one pool's holds
        # Inf, NaN or a key whose logit overflows float32 (each defeats an
        # additive mask), the other's zeros.
        seqs = [(1, 19), (1, 40), (0, 3)]
        case = self.case(seqs, pad_rows=2)
        clean = self.case(seqs, pad_rows=2, garbage=False)
        for name in ("k_pages", "v_pages"):
            x = getattr(case, name)
            x[np.isnan(x)] = bad if name == pool else 0.0
        paged = self.paged()
        out = self.run(paged, case)
        np.testing.assert_array_equal(out, self.run(paged, clean))
        np.testing.assert_allclose(out, clean.expected(), atol=self.atol, rtol=self.rtol)

    def test_a_finite_key_whose_logit_nears_float32s_range_never_matters(self):
        # 10 * scale * 3e38 = 2.7e38 is finite, and still above the real logits
        # after the kernel adds its mask value (-2.4e38): the tail check's bound.
        seqs = [(1, 19), (1, 40)]
        case, clean = (self.case(seqs, garbage=g) for g in (True, False))
        for c in (case, clean):
            c.q[..., 0] = 10.0
        for x in (case.k_pages, case.v_pages):
            x[np.isnan(x)] = 0.0
        case.k_pages[..., 0][np.all(case.k_pages == 0, axis=-1)] = 3e38
        paged = self.paged()
        out = self.run(paged, case)
        np.testing.assert_array_equal(out, self.run(paged, clean))

    def test_table_entries_past_a_full_last_page_name_that_page(self):
        # No partial page, so no copy: the last block's entries past the last
        # page are garbage (clipped, they would name the pool's last page, a
        # NaN one here: "shared" leaves the high pages unreferenced).
        self.agrees([(1, 32), (1, 16)], order="shared", spare_pages=2)

    def test_finite_garbage_is_read_in_place_and_adds_nothing(self):
        # Stale keys past kv_lens (finite, as a freed page's are) take the branch
        # without the copy, and still give the zero-filled run's result bitwise.
        seqs = [(1, 19), (1, 40), (1, 5)]
        case = self.case(seqs, pad_rows=1)
        clean = self.case(seqs, pad_rows=1, garbage=False)
        rng = np.random.default_rng(1)
        for name in ("k_pages", "v_pages"):
            x = getattr(case, name)
            bad = ~np.isfinite(x)
            x[bad] = rng.normal(size=int(bad.sum()))
        paged = self.paged()
        call = dataclasses.replace(paged.call, platform="cpu")
        for c in (case, clean):
            cache = paged.from_canonical(*(jnp.asarray(x, jnp.bfloat16)
                                           for x in (c.k_pages, c.v_pages)))
            lengths, table = _paged_decode._row_pages(call, cache, c.batch(), c.q.shape[0], 2)
            q = jnp.asarray(np.nan_to_num(c.q))
            assert not _paged_decode._tail_is_garbage(call, cache, q, lengths, table)
        out = self.run(paged, case)
        np.testing.assert_array_equal(out[:3], self.run(paged, clean)[:3])

    def test_the_kernel_runs_in_tpu_interpret_mode(self):
        paged = self.paged()
        case = self.case([(1, 20)])
        cache = paged.from_canonical(*(jnp.asarray(x, jnp.bfloat16)
                                       for x in (case.k_pages, case.v_pages)))
        jaxpr = str(jax.make_jaxpr(paged.__call__)(jnp.asarray(case.q, jnp.bfloat16), cache,
                                                   case.batch()))
        assert "pallas_call[" in jaxpr
        text = jax.jit(paged.__call__).lower(jnp.asarray(case.q, jnp.bfloat16), cache,
                                             case.batch()).as_text()
        assert "tpu_custom_call" not in text


# --- selection ----------------------------------------------------------------------

@pytest.fixture
def tpu_registry(monkeypatch):
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    return ab.Registry(only=["flash_pallas", "xla_native", "reference"])


def test_decode_only_bfloat16_calls_on_tpu_take_the_heads_first_layout(tpu_registry):
    paged = tpu_registry.get_paged(device="tpu", num_q_heads=32, num_kv_heads=8,
                                   softcap=30.0, **DECODE)
    assert paged.backend.name == "flash_pallas" and paged.layout == "heads_first"
    # The decode kernel takes any group: 3 kv heads, which the ragged one cannot tile.
    odd = tpu_registry.get_paged(device="tpu", num_q_heads=6, num_kv_heads=3, **DECODE)
    assert odd.backend.name == "flash_pallas" and odd.layout == "heads_first"


@pytest.mark.parametrize("call", [dict(max_q_len=None), dict(max_q_len=2),
                                  dict(dtype="float32"), dict(window=(100, None))],
                         ids=["mixed", "max_q_len=2", "float32", "window"])
def test_windowed_and_float32_decode_calls_take_the_ragged_layout(tpu_registry, call):
    paged = tpu_registry.get_paged(device="tpu", num_q_heads=8, num_kv_heads=2,
                                   **{**DECODE, **call})
    assert paged.backend.name == "flash_pallas" and paged.layout == "kv_combined"


def test_interpret_mode_claims_cpu_for_decode_calls_only(interpreted):
    paged = ab.registry.get_paged(device="cpu", prefer="flash_pallas", num_q_heads=8,
                                  num_kv_heads=2, **DECODE)
    assert paged.backend.name == "flash_pallas" and paged.layout == "heads_first"
    for call, reasons in [
        (dict(max_q_len=None), ["max_q_len=None: JAX's paged_attention takes one query row"]),
        (dict(dtype="float32"), ["dtype float32: JAX's paged_attention rounds K and V to "
                                 "bfloat16"]),
        (dict(window=(7, None)), ["window: JAX's paged_attention always starts at key 0"]),
    ]:
        exp = ab.registry.explain_paged(device="cpu", num_q_heads=8, num_kv_heads=2,
                                        **{**DECODE, **call})
        (verdict,) = [v for v in exp.verdicts if v.backend == "flash_pallas"]
        assert not verdict.accepted
        ragged, *rest = verdict.reasons
        assert "does not run in Pallas' interpreters" in ragged
        assert "'ReshapeTransform' object has no attribute 'indices'" in ragged
        assert "'TypedInt' object has no attribute 'shape'" in ragged
        assert [r for r in rest if any(r.startswith(w) for w in reasons)], verdict.reasons


def test_without_the_switch_cpu_decode_calls_say_how_to_turn_it_on(tpu_registry):
    exp = tpu_registry.explain_paged(device="cpu", num_q_heads=8, num_kv_heads=2, **DECODE)
    (verdict,) = [v for v in exp.verdicts if v.backend == "flash_pallas"]
    (reason,) = verdict.reasons
    assert reason.startswith("platform 'cpu' not in ['tpu'] (Pallas TPU interpret mode is off")
    assert "ATTN_BACKENDS_PALLAS_INTERPRET=1" in reason


def test_the_layout_is_heads_first():
    call = ab.registry.explain_paged(device="tpu", num_q_heads=8, num_kv_heads=4,
                                     **DECODE).call
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(3, 16, 4, 128)), jnp.bfloat16) for _ in range(2))
    cache = FlashPallasBackend().from_canonical(call, k, v)
    assert cache.layout == "heads_first"
    for got, want in zip(cache.arrays, (k, v), strict=True):
        assert got.shape == (4, 3, 16, 128)
        for h in range(4):
            np.testing.assert_array_equal(np.asarray(got[h], np.float32),
                                          np.asarray(want[:, :, h], np.float32))
    zero = FlashPallasBackend().init_cache(call, 5)
    assert [a.shape for a in zero.arrays] == [(4, 5, 16, 128)] * 2
    assert not any(a.any() for a in zero.arrays)


# --- the TPU export -----------------------------------------------------------------

def _decode(monkeypatch) -> ab.PagedAttention:
    """For a tpu JAX does not see here: selected by the manifest, traced for export
    (the switch off, so the program holds the compiled kernel)."""
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    return ab.registry.get_paged(device="tpu", backend="flash_pallas", num_q_heads=8,
                                 num_kv_heads=2, softcap=20.0, **DECODE)


def _gathers(module: str, pool: str) -> list[str]:
    """The result types of the gathers reading the pool."""
    return [re.findall(r"-> (tensor<[^>]*>)", line)[-1] for line in module.splitlines()
            if "stablehlo.gather" in line and pool in line]


def test_tpu_export_holds_the_kernel_reading_the_cache_as_it_lies(monkeypatch):
    paged = _decode(monkeypatch)
    spec = jax.ShapeDtypeStruct
    pool = spec((POOL, 16, 2, 128), jnp.bfloat16)
    cache = jax.eval_shape(paged.from_canonical, pool, pool)
    i32 = jnp.int32
    batch = ab.PagedBatch(spec((9,), i32), spec((8,), i32), spec((8, 6), i32), spec((), i32))
    with jax.sharding.use_abstract_mesh(TPU):
        module = jax.export.export(jax.jit(paged.__call__), platforms=["tpu"])(
            spec((8, 8, 128), jnp.bfloat16), cache, batch).mlir_module()
    # The kernel in place, and on a copy of the batch's pages (lax.cond).
    assert module.count("stablehlo.custom_call @tpu_custom_call") == 2
    assert "paged_flash_attention_kernel" in module
    ops = cache_sized_ops(module, (2, POOL, 16, 128), "bf16")
    assert ops and all("stablehlo.gather" in op for op in ops), ops
    # The only reads of the pool outside the kernel: each row's last page (K, V:
    # 8 rows), and the copy's pages (8 rows x 6 pages), never the pool's size.
    assert sorted(_gathers(module, "tensor<2x37x16x128xbf16>")) == sorted(
        ["tensor<2x8x16x128xbf16>"] * 2 + ["tensor<2x48x16x128xbf16>"] * 2)


def test_write_scatters_into_the_layout_without_a_round_trip(monkeypatch):
    # Only reshapes (merging page and offset, no copy) and one scatter per pool.
    paged = _decode(monkeypatch)
    spec = jax.ShapeDtypeStruct
    cache = jax.eval_shape(lambda: paged.init_cache(POOL))
    token = spec((5, 2, 128), jnp.bfloat16)
    text = jax.export.export(jax.jit(paged.write), platforms=["tpu"])(
        cache, token, token, spec((5,), jnp.int32)).mlir_module()
    pools = cache_sized_ops(text, (2, POOL, 16, 128), "bf16")
    ops = pools + [op for op in cache_sized_ops(text, (2, POOL * 16, 128), "bf16")
                   if op not in pools]  # the reshapes have both types
    kinds = sorted("reshape" if "stablehlo.reshape" in op else
                   "region end" if op.startswith("})") else op for op in ops)
    assert kinds == ["region end"] * 2 + ["reshape"] * 4, ops
    assert text.count('"stablehlo.scatter"') == 2


def test_a_call_that_breaks_max_q_len_gives_nan_rows_when_traced(interpreted):
    # Core's check (the batch is traced under jit): the decode kernel never
    # sees the promise broken silently.
    paged = ab.registry.get_paged(device="cpu", backend="flash_pallas", num_q_heads=4,
                                  num_kv_heads=2, **DECODE)
    case = paged_case([(2, 20), (1, 9)], page_size=16, d=128, garbage=False)
    cache = paged.from_canonical(*(jnp.asarray(x, jnp.bfloat16)
                                   for x in (case.k_pages, case.v_pages)))
    out = np.asarray(jax.jit(paged.__call__)(jnp.asarray(case.q, jnp.bfloat16), cache,
                                             case.batch()), np.float32)
    assert np.isnan(out[:2]).all() and np.isfinite(out[2]).all()
