"""The paged KV-cache contract in core (docs/DESIGN.md, "Paged attention"): selection
at get_paged, explain, validation, garbage, max_q_len, no gradients, layouts.

Every backend here is a fake (``_paged_support``); the ones that compute run the
float64 oracle as a host callback, so these tests judge core's wrapper, not a kernel.
"""

from __future__ import annotations

import warnings

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import make_paged_backend, paged_case
from _support import Plugin, make_backend
from attn_backends.choose.paged import NOT_PAGED

CALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
SEQS = [(5, 5), (1, 9), (3, 6)]  # prefill, decode, chunked prefill


def _loaded(paged: ab.Registry, case) -> tuple:
    cache = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    return jnp.asarray(case.q), cache, case.batch()


# --- selection and explain ---------------------------------------------------


def test_selection_takes_the_highest_paged_backend_and_skips_dense_only_ones(fake_registry):
    reg = fake_registry(make_backend("dense_only", priority=99),
                        make_paged_backend("low", priority=1),
                        make_paged_backend("high", priority=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dense-only backend is never "passed over"
        paged = reg.get_paged(**CALL)
    assert paged.backend.name == "high"
    verdicts = {v.backend: v for v in paged.explain().verdicts}
    assert verdicts["dense_only"].reasons == (NOT_PAGED,)
    assert verdicts["low"].accepted and verdicts["high"].accepted


def test_a_refused_paged_backend_is_passed_over_with_its_reason(fake_registry):
    reg = fake_registry(make_paged_backend("nowindow", priority=9, window=False),
                        make_paged_backend("any", priority=1))
    with pytest.warns(ab.FallbackWarning, match="nowindow: feature 'window' not supported"):
        assert reg.get_paged(**CALL, window=(3, None)).backend.name == "any"
    with pytest.raises(ab.UnsupportedError, match="fallback='error'"):
        reg.get_paged(**CALL, window=(3, None), fallback="error")
    with pytest.raises(ab.UnsupportedError, match="backend='nowindow' cannot serve"):
        reg.get_paged(**CALL, window=(3, None), backend="nowindow")
    assert reg.get_paged(**CALL).backend.name == "nowindow"


def test_unknown_names_in_prefer_and_options_warn(fake_registry):
    reg = fake_registry(make_paged_backend("pg"))
    with pytest.warns(ab.AttnBackendsWarning, match=r"prefer=\['pgg'\]: 'pgg' not installed"):
        reg.get_paged(**CALL, prefer="pgg")
    with pytest.warns(ab.AttnBackendsWarning, match="backend_options: 'pq' not installed"):
        reg.get_paged(**CALL, backend_options={"pq": None})


def test_manifest_and_check_paged_reasons(fake_registry):
    reg = fake_registry(
        make_paged_backend("decode_only", max_q_len=1, page_sizes={16}),
        make_paged_backend("broken", check_paged=lambda call: 1 / 0),
        make_paged_backend("picky", check_paged=lambda call: ["no head_dim 8 here"]),
        make_backend("dense_only"))
    explanation = reg.explain_paged(**CALL)
    reasons = {v.backend: v.reasons for v in explanation.verdicts}
    assert explanation.chosen is None
    assert reasons["decode_only"] == (
        "page_size=4 not in [16]",
        "max_q_len=None: serves at most 1 query rows per sequence")
    assert reasons["broken"] == ("check_paged() raised ZeroDivisionError: division by zero",)
    assert reasons["picky"] == ("no head_dim 8 here",)
    with pytest.raises(ab.NoBackendError, match="no backend can serve paged"):
        reg.get_paged(**CALL)
    decode = reg.explain_paged(**{**CALL, "page_size": 16}, max_q_len=1)
    assert decode.chosen == "decode_only"
    assert "CHOSEN" in str(decode) and "no paged support" in str(decode)


def test_explain_paged_on_the_command_line(fake_registry, monkeypatch, capsys):
    from attn_backends_cli import main as cli

    reg = fake_registry(make_paged_backend("pg"), make_backend("dense_only"))
    monkeypatch.setattr(cli, "_registry", lambda: reg)
    assert cli.main(["explain", "--paged", "--heads", "4,2", "--head-dim", "8",
                     "--page-size", "4", "--max-q-len", "1", "--window", "3,"]) == 0
    text = capsys.readouterr().out
    assert "pg" in text and "CHOSEN" in text and "max_q_len=1" in text
    assert "dense_only" in text and NOT_PAGED in text


# --- validation --------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    ({"num_q_heads": 3}, "num_q_heads=3 to be a multiple of num_kv_heads=2"),
    ({"page_size": 0}, "page_size: expected an int >= 1, got 0"),
    ({"head_dim": 8.0}, "head_dim: expected a static Python int"),
    ({"dtype": "int32"}, "dtype: expected dtype float32"),
    ({"window": (3, 2)}, "window: expected \\(left, None\\), got right side 2"),
    ({"max_q_len": 0}, "max_q_len: expected an int >= 1, got 0"),
    ({"softcap": -1.0}, "softcap: expected a finite value > 0"),
    ({"dtype": "float64"}, "dtype: dtype float64 needs jax_enable_x64"),
])
def test_bad_call_arguments_are_named(fake_registry, change, message):
    reg = fake_registry(make_paged_backend("pg"))
    with pytest.raises(ValueError, match=message):
        reg.get_paged(**{**CALL, **change})


def test_bad_write_and_attend_arguments_are_named(fake_registry):
    paged = fake_registry(make_paged_backend("pg")).get_paged(**CALL)
    cache = paged.init_cache(6)
    k = jnp.zeros((3, 2, 8))
    slots = jnp.arange(3, dtype=jnp.int32)
    bad_writes = [
        ((jnp.zeros((3, 4, 8)), k, slots), "k: expected shape \\[\\*, 2, 8\\], got \\[3, 4, 8\\]"),
        ((k, jnp.zeros((2, 2, 8)), slots), "v: expected shape \\[3, 2, 8\\], got \\[2, 2, 8\\]"),
        ((k.astype(jnp.bfloat16), k, slots), "k: expected dtype float32 .*got bfloat16"),
        ((k, k, slots.astype(jnp.float32)), "slots: expected an integer dtype"),
        ((k, k, jnp.asarray([0, 1, 24], jnp.int32)), "slots: expected each < .* = 24"),
    ]
    for args, message in bad_writes:
        with pytest.raises(ValueError, match=message):
            paged.write(cache, *args)
    case = paged_case(SEQS, page_size=4)
    q, _, batch = _loaded(paged, case)
    bad_calls = [
        ((q[:, :2], cache, batch), "q: expected shape \\[\\*, 4, 8\\]"),
        ((q, "cache", batch), "cache: expected an attn_backends.KVCache"),
        ((q, cache, tuple(batch)), "batch: expected an attn_backends.PagedBatch"),
        ((q, cache, batch._replace(cu_q_lens=batch.cu_q_lens[:-1])),
         "batch.cu_q_lens: expected shape \\[4\\], got \\[3\\]"),
        ((q, cache, batch._replace(page_table=batch.page_table[0])),
         "batch.page_table: expected shape \\[3, \\*\\]"),
        ((q, cache, batch._replace(kv_lens=batch.kv_lens.astype(jnp.float32))),
         "batch.kv_lens: expected an integer dtype"),
        ((q, cache, batch._replace(num_seqs=jnp.zeros((2,), jnp.int32))),
         "batch.num_seqs: expected shape \\[\\]"),
    ]
    for args, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            paged(*args)


def test_bad_batch_values_are_caught_when_concrete(fake_registry):
    paged = fake_registry(make_paged_backend("pg")).get_paged(**CALL)
    case = paged_case(SEQS, page_size=4, garbage=False)
    q, cache, batch = _loaded(paged, case)
    cases = [
        (batch._replace(num_seqs=jnp.int32(4)), "num_seqs: expected 0 <= num_seqs <= 3"),
        (batch._replace(cu_q_lens=jnp.asarray([0, 5, 4, 9], jnp.int32)),
         "cu_q_lens: expected to start at 0 and not decrease"),
        (batch._replace(kv_lens=jnp.asarray([4, 9, 6], jnp.int32)),
         "kv_lens: expected q_len <= kv_len"),
        (batch._replace(page_table=batch.page_table.at[1, 2].set(99)),
         "page_table: sequence 1 references pages .*99.*expected each in \\[0, 9\\)"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            paged(q, cache, bad)


def test_a_cache_of_another_layout_is_refused(fake_registry):
    reg = fake_registry(make_paged_backend("canon", priority=1),
                        make_paged_backend("hf", layout="heads_first", priority=2))
    canon, heads_first = reg.get_paged(**CALL, backend="canon"), reg.get_paged(**CALL)
    case = paged_case(SEQS, page_size=4)
    q, cache, batch = _loaded(heads_first, case)
    with pytest.raises(ValueError, match="expected layout 'canonical' .*got a cache in "
                                         "layout 'heads_first'"):
        canon(q, cache, batch)
    other_pages = reg.get_paged(**{**CALL, "page_size": 2}, backend="canon").init_cache(4)
    with pytest.raises(ValueError, match="cache: expected page_size 4, got 2"):
        canon(q, other_pages, batch)


# --- results -----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["canonical", "heads_first"])
def test_garbage_never_changes_a_result_and_layouts_round_trip(fake_registry, layout):
    paged = fake_registry(make_paged_backend("pg", layout=layout)).get_paged(**CALL)
    dirty = paged_case(SEQS + [(2, 3)], page_size=4, num_seqs=3, pad_rows=2)
    clean = paged_case(SEQS + [(2, 3)], page_size=4, num_seqs=3, pad_rows=2, garbage=False)
    q, cache, batch = _loaded(paged, dirty)
    assert cache.layout == layout
    k, v = paged.to_canonical(cache)
    np.testing.assert_array_equal(np.asarray(k), dirty.k_pages)  # NaN where NaN was
    np.testing.assert_array_equal(np.asarray(v), dirty.v_pages)
    out = np.asarray(jax.jit(paged.__call__)(q, cache, batch))
    np.testing.assert_array_equal(out, np.asarray(paged(*_loaded(paged, clean))))
    np.testing.assert_allclose(out, clean.expected(), atol=1e-6)
    assert np.all(out[9:] == 0)  # padding rows: zeros, whatever q held there


def test_write_puts_each_token_at_its_slot_and_nothing_else(fake_registry):
    paged = fake_registry(make_paged_backend("pg", layout="heads_first")).get_paged(**CALL)
    case = paged_case(SEQS, page_size=4)
    before = paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.normal(size=(4, 2, 8)), jnp.float32) for _ in "kv")
    slots = jnp.asarray([3, -1, 17, -7], jnp.int32)
    after = jax.jit(paged.write, donate_argnums=0)(
        paged.from_canonical(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages)), k, v, slots)
    (k0, v0), (k1, v1) = paged.to_canonical(before), paged.to_canonical(after)
    for old, new, rows in ((k0, k1, k), (v0, v1, v)):
        old, new = np.asarray(old).reshape(-1, 2, 8), np.asarray(new).reshape(-1, 2, 8)
        np.testing.assert_array_equal(new[[3, 17]], np.asarray(rows)[[0, 2]])
        untouched = np.setdiff1d(np.arange(old.shape[0]), [3, 17])
        np.testing.assert_array_equal(new[untouched], old[untouched])  # padding: not written


def test_max_q_len_is_refused_eagerly_and_flagged_with_nan_under_jit(fake_registry):
    paged = fake_registry(make_paged_backend("pg")).get_paged(**CALL, max_q_len=3)
    case = paged_case(SEQS, page_size=4, garbage=False)
    q, cache, batch = _loaded(paged, case)
    with pytest.raises(ValueError, match="sequence 0 has 5 query rows, more than max_q_len=3"):
        paged(q, cache, batch)
    out = np.asarray(jax.jit(paged.__call__)(q, cache, batch))
    assert np.isnan(out[:5]).all()
    np.testing.assert_allclose(out[5:], case.expected()[5:], atol=1e-6)


def test_gradients_are_refused(fake_registry):
    paged = fake_registry(make_paged_backend("pg")).get_paged(**CALL)
    q, cache, batch = _loaded(paged, paged_case(SEQS, page_size=4, garbage=False))
    with pytest.raises(ab.UnsupportedError, match="paged attention \\(pg\\) has no gradients"):
        jax.grad(lambda q: paged(q, cache, batch).sum())(q)
    with pytest.raises(ab.UnsupportedError, match="has no gradients"):
        jax.grad(lambda c: paged(q, c, batch).sum())(cache)


def test_paged_attention_is_not_loaded_by_import():
    import subprocess
    import sys

    code = ("import sys, attn_backends\n"
            "print('attn_backends.choose.paged' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_a_paged_attention_for_an_absent_platform_exports_for_it_and_runs_nowhere_else():
    """On this cpu machine, a tpu selection traces for jax.export(platforms=["tpu"]);
    running it, or lowering it for cpu, raises PlatformUnavailableError."""
    backend = make_paged_backend("tpu_only", platforms=("tpu",))
    # A plain-jnp program (the fakes' oracle is a host callback, which no export holds).
    backend.attend_paged = lambda call, q, cache, batch, options=None: q * cache.arrays[0].max()
    registry = ab.Registry(plugins=[Plugin(backend)], autoload=False, probe=None)
    paged = registry.get_paged(device="tpu", num_q_heads=4, num_kv_heads=2, head_dim=8,
                               page_size=4, dtype="float32")
    assert not paged.present
    cache = jax.eval_shape(lambda: paged.init_cache(6))
    i32 = jnp.int32
    batch = ab.PagedBatch(jax.ShapeDtypeStruct((3,), i32), jax.ShapeDtypeStruct((2,), i32),
                          jax.ShapeDtypeStruct((2, 3), i32), jax.ShapeDtypeStruct((), i32))
    q = jax.ShapeDtypeStruct((5, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((5, 2, 8), jnp.float32)
    slots = jax.ShapeDtypeStruct((5,), i32)
    for fn, args in ((paged.__call__, (q, cache, batch)), (paged.write, (cache, kv, kv, slots))):
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
        assert exported.platforms == ("tpu",)
        assert "attn_backends_platform_unavailable" not in exported.mlir_module()
        with pytest.raises(ab.PlatformUnavailableError, match="JAX sees no tpu here"):
            jax.jit(fn).lower(*args).compile()
    with pytest.raises(ab.PlatformUnavailableError, match="JAX sees no tpu here"):
        paged(jnp.zeros((5, 4, 8)), paged.init_cache(6),
              ab.PagedBatch(jnp.array([0, 2, 5]), jnp.array([2, 3]), jnp.zeros((2, 3), i32),
                            jnp.int32(2)))
