"""Quantized K and V in the dense call (docs/DESIGN.md, "Quantized caches"):
``attention(q, k, v, k_scales=, v_scales=)`` with k and v in int8 or float8,
as a model keeping a quantized contiguous cache calls it. Bad input named;
selection passes over a backend reading no quantized K and V with its reason;
gradients and sharded calls refused with a message; the BHTD layout; the
answer against the float64 oracle on the dequantized values (the suite's
``quantized`` family judges every backend that claims them).

The installed backends here: reference and xla_native claim every quantized
dtype, native_cpu none.
"""

from __future__ import annotations

import warnings
from typing import Any

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.authoring import QUANTIZED_KV_DTYPES
from attn_backends.oracle import attention, dequantize_rows, quantize_rows

B, T, HQ, HKV, D = 2, 40, 4, 2, 16


@pytest.fixture
def registry() -> ab.Registry:
    return ab.Registry(probe=None, only=["reference", "xla_native", "native_cpu"])


def _arrays(kv_dtype: str = "int8", seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k, ks = quantize_rows(rng.standard_normal((B, T, HKV, D)) * 3, kv_dtype)
    v, vs = quantize_rows(rng.standard_normal((B, T, HKV, D)), kv_dtype)
    return q, k, v, ks, vs


def test_bad_scales_and_unquantized_calls_are_named() -> None:
    q, k, v, ks, vs = _arrays()
    with pytest.raises(ValueError, match=r"k_scales: k and v are quantized \(int8\), so their "
                                         r"float32 scales \[2, 40, 2\] \[B, Tk, Hkv\] are "
                                         "needed .*got None"):
        ab.bind(q, k, v)
    with pytest.raises(ValueError, match=r"v_scales: expected shape \[B, Tk, Hkv\] = "
                                         r"\[2, 40, 2\] .*got \[2, 2, 40\]; it looks like "
                                         r"\[B, Hkv, Tk\].*x.transpose\(0, 2, 1\)"):
        ab.bind(q, k, v, k_scales=ks, v_scales=vs.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="k_scales: expected dtype float32, got float16; "
                                         r"pass x.astype\(jnp.float32\)"):
        ab.bind(q, k, v, k_scales=ks.astype(np.float16), v_scales=vs)
    with pytest.raises(ValueError, match="k_scales: given with k and v in float32, which are "
                                         "not quantized"):
        ab.bind(q, k.astype(np.float32), v.astype(np.float32), k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match=r"k, v: expected both quantized in one dtype \(with "
                                         r"k_scales and v_scales\), got k=int8, "
                                         "v=float8_e4m3fn"):
        ab.bind(q, k, v.astype(jnp.float8_e4m3fn), k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match=r"k: expected dtype float32.*got uint8; or, stored "
                                         r"quantized, one of \['int8'"):
        ab.bind(q, k.astype(np.uint8), v.astype(np.uint8))
    with pytest.raises(ValueError, match="kv_dtypes must be a collection of dtype names"):
        ab.Capabilities(platforms={"cpu"}, kv_dtypes="int8")
    with pytest.raises(ValueError, match="q: expected dtype float32, bfloat16 or float16"):
        ab.bind(q.astype(np.int8), k, v, k_scales=ks, v_scales=vs)
    call, ops = ab.bind(q, k, v, k_scales=ks, v_scales=vs, causal=True)
    assert call.kv_dtype == "int8" and call.dtype == "float32"
    assert ops.k_scales is ks and ops.v_scales is vs
    assert "kv=int8" in call.describe()


@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES)
def test_selection_passes_over_a_backend_reading_none_and_the_answer_is_the_oracles(
        registry: ab.Registry, kv_dtype: str) -> None:
    q, k, v, ks, vs = _arrays(kv_dtype)
    lengths = np.array([40, 23], np.int32)
    attn = registry.get(device="cpu")
    verdicts = {x.backend: x for x in registry.explain(q, k, v, k_scales=ks, v_scales=vs,
                                                       device="cpu").verdicts}
    assert list(verdicts["native_cpu"].reasons) == [
        f"kv dtype {kv_dtype}: reads no such quantized K, V (reads none)"]
    assert verdicts["xla_native"].accepted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.jit(lambda *a: attn(*a[:3], k_scales=a[3], v_scales=a[4], causal=True,
                                      kv_lengths=a[5]))(q, k, v, ks, vs, lengths)
    assert any(issubclass(w.category, ab.FallbackWarning) and "native_cpu" in str(w.message)
               for w in caught)
    want, _ = attention(q, dequantize_rows(k, ks), dequantize_rows(v, vs), causal=True,
                        kv_lengths=lengths)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=0)
    with pytest.raises(ab.UnsupportedError, match="kv dtype"):
        registry.get(device="cpu", backend="native_cpu", fallback="error")(
            q, k, v, k_scales=ks, v_scales=vs)


def test_a_gradient_is_refused_as_forward_only(registry: ab.Registry) -> None:
    q, k, v, ks, vs = _arrays()
    for name in ("reference", "xla_native"):
        attn = registry.get(device="cpu", backend=name)

        def loss(q, k_scales, attn=attn):
            return attn(q, k, v, k_scales=k_scales, v_scales=vs).sum()

        for argnums in (0, 1):
            with pytest.raises(ab.UnsupportedError, match="quantized K and V .* forward only"):
                jax.grad(loss, argnums)(q, ks)


def test_the_bhtd_layout_takes_the_same_scales(registry: ab.Registry) -> None:
    q, k, v, ks, vs = _arrays("float8_e5m2")
    bhtd = registry.get(device="cpu", backend="xla_native", layout="BHTD")
    out = bhtd(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), k_scales=ks, v_scales=vs,
               window=(5, 3))
    want, _ = attention(q, dequantize_rows(k, ks), dequantize_rows(v, vs), window=(5, 3))
    np.testing.assert_allclose(np.asarray(out).transpose(0, 2, 1, 3), want, atol=2e-5, rtol=0)


def test_a_sharded_call_is_refused_with_a_message(registry: ab.Registry) -> None:
    q, k, v, ks, vs = _arrays()
    mesh = jax.make_mesh((1,), ("data",))
    sharded = registry.get(device="cpu", mesh=mesh, spec=jax.P("data"))
    for run in (sharded, sharded.explain):  # explain says what the call does
        with pytest.raises(ab.UnsupportedError, match=r"quantized K and V \(int8\) is served "
                                                      "on a single device only"):
            run(q, k, v, k_scales=ks, v_scales=vs)


def test_dropout_over_a_quantized_k_and_v_is_the_references(registry: ab.Registry) -> None:
    # Both draw authoring's keep-mask from the key: the same weights dropped.
    q, k, v, ks, vs = _arrays("int8", seed=4)
    key = jax.random.key(7)
    outs = [registry.get(device="cpu", backend=name)(
        q, k, v, k_scales=ks, v_scales=vs, causal=True, dropout_rate=0.25, dropout_key=key)
        for name in ("reference", "xla_native")]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=2e-5, rtol=0)


def test_explain_on_the_command_line_names_the_kv_dtype(registry: ab.Registry, monkeypatch,
                                                          capsys) -> None:
    from attn_backends_cli import main as cli

    monkeypatch.setattr(cli, "_registry", lambda: registry)
    assert cli.main(["explain", "--device", "cpu", "--q", "1,16,4,16", "--kv", "1,16,2,16",
                     "--layout", "BTNH", "--kv-dtype", "float8_e4m3fn"]) == 0
    text = capsys.readouterr().out
    assert "kv=float8_e4m3fn" in text and "kv dtype float8_e4m3fn: reads no such" in text
    assert "xla_native" in text and "CHOSEN" in text


def test_xla_native_never_holds_a_dequantized_copy_of_k_or_v(registry: ab.Registry) -> None:
    # The compiled program's temporaries, 4,096 keys of 2 kv heads: the int8
    # call's (K's int8 blocks, the score tiles, one block's float32 K and V)
    # stay below the float32 call's (which holds K transposed in float32); a
    # float32 copy of the dequantized K and V (4 MiB) would put them above.
    sds = jax.ShapeDtypeStruct
    q = sds((1, 256, 8, 64), jnp.float32)
    attn = registry.get(device="cpu", backend="xla_native")

    def temp(dtype: Any, **scales: Any) -> int:
        kv = sds((1, 4096, 2, 64), dtype)
        program = jax.jit(lambda q, k, v, s: attn(q, k, v, causal=True, **s))
        compiled = program.lower(q, kv, kv, scales).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scales = sds((1, 4096, 2), jnp.float32)
    quantized = temp(jnp.int8, k_scales=scales, v_scales=scales)
    plain = temp(jnp.float32)
    assert quantized < plain, (quantized, plain)


def test_tune_refuses_to_time_the_backward_of_a_quantized_call(registry: ab.Registry,
                                                                 monkeypatch, capsys,
                                                                 tmp_path) -> None:
    from attn_backends_cli import main as cli

    monkeypatch.setattr(cli, "_registry", lambda: registry)
    refused = ("attention over a quantized K and V is forward only; tune it without --grad "
               "or --both")
    for flag in ("--both", "--grad"):
        assert cli.main(["tune", "--device", "cpu", "--q", "1,16,4,16", "--kv", "1,16,2,16",
                         "--kv-dtype", "int8", flag]) == 2
        assert f"--kv-dtype int8: {refused}" in capsys.readouterr().err
    calls = tmp_path / "calls.txt"
    calls.write_text("--q 1,16,4,16 --kv 1,16,2,16 --kv-dtype int8\n"
                     "--q 1,16,4,16 --kv 1,16,2,16 --kv-dtype float8_e5m2 --grad\n")
    assert cli.main(["tune", "--device", "cpu", "--from", str(calls)]) == 2
    assert f"{calls}:2: --kv-dtype float8_e5m2: {refused}" in capsys.readouterr().err


def test_the_probe_judges_a_quantized_call_on_the_dequantized_values() -> None:
    # Two fakes claiming int8 K and V: one forgets the scales (ranked first), one
    # reads value * scale. The probe, on its own quantized inputs, passes over
    # the first with the oracle's reason and serves the second.
    from _support import Plugin, dense, make_backend

    def reads(call, q, k, v, ops, scaled=True):
        k, v = (x.astype(jnp.float32) * (s[..., None] if scaled else 1.0)
                for x, s in ((k, ops.k_scales), (v, ops.v_scales)))
        return dense(call, q, k, v, ops)

    forgets = make_backend("forgets", priority=95, kv_dtypes={"int8"},
                           attend=lambda *a: reads(*a, scaled=False))
    good = make_backend("good", priority=90, kv_dtypes={"int8"}, attend=reads)
    registry = ab.Registry(plugins=[Plugin(forgets, good)], autoload=False)
    q, k, v, ks, vs = _arrays()
    with pytest.warns(ab.FallbackWarning, match="served by 'good', passing over forgets: "
                                                "probe: out differs from the float64 oracle"):
        out = registry.get(device="cpu")(q, k, v, k_scales=ks, v_scales=vs, causal=True)
    want, _ = attention(q, dequantize_rows(k, ks), dequantize_rows(v, vs), causal=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=0)
