"""Decode calls through the flash_pallas decode kernel: interpret mode and TPU export.

A call with Tq <= 8 (float32 or bfloat16) is evaluated by ``_decode_kernel``
and differentiated through splash (a ``custom_vjp``). Checked against the
float64 oracle in Pallas' interpret mode; lowering for TPU by ``jax.export``,
whose StableHLO must hold the kernel and no cache-sized data movement outside
it. Shapes span several key blocks (interpret mode uses blocks of 128 keys:
Tk = 1100 is 9 blocks, the last partial), so the online softmax crosses blocks.
"""

from __future__ import annotations

import dataclasses
import re

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_flash_pallas import FlashPallasBackend, _decode, interpret_mode
from attn_backends_contracts._oracle import attention, attention_vjp

BACKEND = FlashPallasBackend()
#: bfloat16 output: one rounding (2**-9 relative) on top of float32 arithmetic.
TOL = 8e-3
#: float32 cache: nothing is rounded to bfloat16 on the way (JAX's paged kernel
#: gave 1.2e-3 here, README), so float32 arithmetic over a few hundred keys.
TOL32 = 2e-5
KERNEL = "contiguous_decode_attention"  # the pallas_call's name, in the jaxpr and the export


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _decode_inputs(b, tq, tk, hq, hkv, d, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    shapes = ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _attend(call, operands):
    return jax.jit(lambda q, k, v: BACKEND.attend(call, q, k, v, operands))


def test_declines_route_only_what_the_kernel_can_serve():
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 64, 2, 128), jnp.bfloat16)
    call, _ = attn_backends.bind(q, k, k, causal=True, kv_lengths=jnp.array([5, 9]))
    assert _decode.declines(call) == []
    f32 = attn_backends.bind(q.astype(jnp.float32), k.astype(jnp.float32),
                             k.astype(jnp.float32))[0]
    assert _decode.declines(f32) == []  # the kernel widens K and V, never rounds them
    # A short cache is one block (a block dim equal to the array's); a long one
    # is cut in multiples of 8, smaller for wide rows (VMEM).
    assert _decode.block_k(call, interpret=False) == 64
    long = attn_backends.bind(q, jnp.zeros((2, 5000, 2, 128), jnp.bfloat16),
                              jnp.zeros((2, 5000, 2, 128), jnp.bfloat16))[0]
    assert _decode.block_k(long, interpret=False) == 512
    assert _decode.block_k(long, interpret=True) == 128
    wide = attn_backends.bind(jnp.zeros((1, 1, 32, 256)), jnp.zeros((1, 5000, 32, 256)),
                              jnp.zeros((1, 5000, 32, 256)))[0]
    assert _decode.block_k(wide, interpret=False) == 32  # 32 * 32 * 256 * 4 bytes = 1 MiB
    refusals = {
        "Tq": attn_backends.bind(
            jnp.zeros((2, _decode.DECODE_MAX_Q + 1, 8, 128), jnp.bfloat16), k, k)[0],
        "return_lse": attn_backends.bind(q, k, k, return_lse=True)[0],
        "segment_ids": attn_backends.bind(
            q, k, k, segment_ids=(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 64), jnp.int32)))[0],
        "window": attn_backends.bind(q, k, k, window=(4, 0))[0],
        "head dims": attn_backends.bind(q[..., :64], k[..., :64], k[..., :64])[0],
    }
    for word, refused in refusals.items():
        reasons = _decode.declines(refused)
        assert any(word in r for r in reasons), (word, reasons)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, TOL), (jnp.float32, TOL32)],
                         ids=["bfloat16", "float32"])
def test_decode_step_gqa_lengths_softcap_matches_oracle_and_runs_the_kernel(dtype, tol):
    # One token against a cache of 1100 (9 blocks of 128, the last partial):
    # GQA 8:2, ragged lengths (one inside the partial block), one empty cache.
    q, k, v = _decode_inputs(3, 1, 1100, 8, 2, 128, dtype=dtype)
    kw = dict(causal=True, kv_lengths=np.array([1100, 700, 0], np.int32), softcap=2.0)
    call, ops = attn_backends.bind(q, k, v, **kw)
    assert _decode.block_k(call, interpret=True) == 128
    with interpret_mode():
        fn = _attend(call, ops)
        assert KERNEL in str(jax.make_jaxpr(fn)(q, k, v))
        out = _f64(fn(q, k, v))
    want, _ = attention(_f64(q), _f64(k), _f64(v), **kw)
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    assert np.all(out[2] == 0.0)


def test_window_right_side_and_mqa_float32():
    # window (None, 1), not causal: row i of 3 sees keys up to i + (Tk - 3) + 1,
    # so row 0 of the full cache misses its last key, rows 1 and 2 see all;
    # MQA (one kv head for 4 query heads).
    q, k, v = _decode_inputs(2, 3, 300, 4, 1, 128, seed=4, dtype=jnp.float32)
    kw = dict(window=(None, 1), kv_lengths=np.array([300, 150], np.int32))
    call, ops = attn_backends.bind(q, k, v, **kw)
    assert _decode.declines(call) == []
    with interpret_mode():
        out = _f64(_attend(call, ops)(q, k, v))
    want, _ = attention(_f64(q), _f64(k), _f64(v), **kw)
    np.testing.assert_allclose(out, want, atol=TOL32, rtol=TOL32)


def test_speculative_rows_q_lengths_garbage_and_gradients_through_splash():
    # Four rows (bottom-right causal: each row sees one key more), group of 8, a
    # row past q_lengths, NaN and Inf in every key past kv_lengths and huge
    # values in the dead row: hidden positions must change nothing. Nothing
    # zeroes them before the kernel, so its own masks are what is tested.
    q, k, v = _decode_inputs(2, 4, 40, 8, 1, 128, seed=1)
    kv_lengths = np.array([40, 29], np.int32)
    q_lengths = np.array([4, 3], np.int32)
    hidden = np.arange(40)[None, :] >= kv_lengths[:, None]
    kw = dict(causal=True, kv_lengths=kv_lengths, q_lengths=q_lengths)
    want, _ = attention(_f64(q), _f64(k), _f64(v), **kw)
    ref = attention_vjp(_f64(q), _f64(k), _f64(v), _f64(d_out := jnp.asarray(
        np.random.default_rng(2).standard_normal(q.shape), jnp.bfloat16)), **kw)
    k_bad = jnp.where(hidden[:, :, None, None], jnp.nan, k).astype(jnp.bfloat16)
    v_bad = jnp.where(hidden[:, :, None, None], jnp.inf, v).astype(jnp.bfloat16)
    q = q.at[1, 3].set(3e38)
    call, ops = attn_backends.bind(q, k_bad, v_bad, **kw)
    with interpret_mode():
        fn = _attend(call, ops)
        out = fn(q, k_bad, v_bad)
        # Splash's backward needs finite hidden keys (README): huge, not NaN.
        k_big = jnp.where(hidden[:, :, None, None], 3e38, k).astype(jnp.bfloat16)
        v_big = jnp.where(hidden[:, :, None, None], -3e38, v).astype(jnp.bfloat16)
        _, vjp = jax.vjp(fn, q, k_big, v_big)
        grads = vjp(d_out)
        grad_program = str(jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1](d_out))(q, k, v))
    assert KERNEL not in grad_program, "a differentiated call must not run the decode kernel"
    np.testing.assert_allclose(_f64(out), want, atol=TOL, rtol=TOL)
    for name, got in zip("qkv", grads, strict=True):
        got = _f64(got)
        assert np.isfinite(got).all(), f"d{name} has non-finite entries"
        scale = max(1.0, float(np.abs(ref[name]).max()))
        np.testing.assert_allclose(got, ref[name], atol=3e-2 * scale, rtol=3e-2, err_msg=name)


def test_vmap_folds_into_the_kernel_batch():
    q, k, v = _decode_inputs(2, 1, 200, 4, 4, 128, seed=3)
    lengths = np.array([[150], [37]], np.int32)  # per vmapped slice: [B=1]

    def one(q, k, v, n):
        call, ops = attn_backends.bind(q, k, v, kv_lengths=n)
        return BACKEND.attend(call, q, k, v, ops)

    with interpret_mode():
        out = jax.jit(jax.vmap(one))(q[:, None], k[:, None], v[:, None], lengths)
    for i in range(2):
        want, _ = attention(_f64(q[i:i + 1]), _f64(k[i:i + 1]), _f64(v[i:i + 1]),
                            kv_lengths=lengths[i])
        np.testing.assert_allclose(_f64(out[i]), want, atol=TOL, rtol=TOL)


def _spec(shape, dtype="bfloat16"):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


_TENSOR = re.compile(r"tensor<((?:\d+x)+)([a-z]+\d*)>")
_OP = re.compile(r"=\s*\"?stablehlo\.([a-z_]+)")
_FUNC = re.compile(r"func\.func (?:public|private) @([\w.]+)")
_CALL = re.compile(r"call @([\w.]+)\(")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "f64": 8, "i8": 1, "i1": 1}


def cache_sized_ops(mlir: str, elements: int) -> list[tuple[str, str, int]]:
    """(op, result type, bytes) of every StableHLO op whose result holds at least
    ``elements`` values, outside the custom calls (a ``tpu_custom_call``'s
    kernel is serialised in its backend_config, so its inside is not text here).

    An op in a private function (``jnp.where`` and ``jnp.pad`` lower to one)
    is listed once per call of it from ``main``. Each op is read from its own
    line: the last ``tensor<...>`` there is its result. Function signatures,
    calls and returns are not ops that move data.
    """
    ops: dict[str, list[tuple[str, str, int]]] = {}
    calls: dict[str, list[str]] = {}
    func = None
    for line in mlir.splitlines():
        if (start := _FUNC.search(line)) is not None:
            func = start.group(1)
            ops[func], calls[func] = [], []
            continue
        if func is None:
            continue
        calls[func] += [name for name in _CALL.findall(line) if name != "tpu_custom_call"]
        op, types = _OP.search(line), _TENSOR.findall(line)
        if op is None or op.group(1) in ("custom_call", "return") or not types:
            continue
        dims, dtype = types[-1]
        count = int(np.prod([int(n) for n in dims.rstrip("x").split("x")]))
        if count >= elements:
            ops[func].append((op.group(1), f"{dims}{dtype}", count * _BYTES[dtype]))

    def run(name: str) -> list[tuple[str, str, int]]:
        return ops[name] + [op for callee in calls[name] for op in run(callee)]

    return run("main")


def export_decode_step(batch=4, kv_len=1024, kv_heads=2, q_heads=8, head_dim=128,
                       interpret=False):
    """The StableHLO of one bfloat16 decode step (causal, kv_lengths), exported for tpu."""
    registry = attn_backends.Registry(only=["flash_pallas"])
    attention_fn = registry.get(device="tpu", backend="flash_pallas")

    def step(q, k, v, n):
        return attention_fn(q, k, v, causal=True, kv_lengths=n)

    cache = (batch, kv_len, kv_heads, head_dim)
    args = (_spec((batch, 1, q_heads, head_dim)), _spec(cache), _spec(cache),
            _spec((batch,), "int32"))
    with interpret_mode(interpret):
        return jax.export.export(jax.jit(step), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("interpret", [False, True], ids=["switch-off", "switch-on"])
def test_export_for_tpu_reads_the_cache_in_place(interpret):
    # The shape: bf16, B=4, Tk=1024, Hkv=2, Hq=8, D=128. Outside the
    # kernel only reshapes (merging Hkv and D: no data moves in row-major
    # order) may have the cache's size: no transpose, pad, copy, select,
    # concatenate or gather of K or V (JAX's paged kernel needed a transpose).
    mlir = export_decode_step(interpret=interpret)
    big = cache_sized_ops(mlir, 4 * 1024 * 2 * 128)
    assert [op for op, _, _ in big] == ["reshape", "reshape"], big
    assert mlir.count("tpu_custom_call") == 1 and KERNEL in mlir


def test_cache_sized_ops_finds_a_transpose_by_shape():
    # The helper's teeth: a program that transposes the cache is caught, one
    # that only reads it is not.
    cache = _spec((4, 1024, 2, 128))
    moved = jax.jit(lambda k: k.transpose(2, 0, 1, 3)[:, :, :1])
    kept = jax.jit(lambda k: k[:, :1] * 2)
    found = cache_sized_ops(jax.export.export(moved)(cache).mlir_module(), 4 * 1024 * 2 * 128)
    assert [(op, ty) for op, ty, _ in found] == [("transpose", "2x4x1024x128xbf16")]
    assert found[0][2] == 4 * 1024 * 2 * 128 * 2
    assert cache_sized_ops(jax.export.export(kept)(cache).mlir_module(), 4 * 1024 * 2 * 128) == []


def test_export_of_the_gradient_runs_splash_not_the_decode_kernel():
    registry = attn_backends.Registry(only=["flash_pallas"])
    attention_fn = registry.get(device="tpu", backend="flash_pallas")

    def loss(q, k, v, n):
        return attention_fn(q, k, v, causal=True, kv_lengths=n).astype(jnp.float32).sum()

    args = (_spec((8, 1, 32, 128)), _spec((8, 4096, 8, 128)), _spec((8, 4096, 8, 128)),
            _spec((8,), "int32"))
    train = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                              platforms=["tpu"])(*args).mlir_module()
    # Splash forward, dkv and dq kernels, never the decode kernel.
    assert train.count("tpu_custom_call") >= 3 and KERNEL not in train


def _cache_of_the_previous_example(decode_fn):
    def build(plan):
        call = decode_fn(plan)
        return lambda q, k, v, lengths, limit: call(
            q, jnp.roll(k, 1, axis=0), jnp.roll(v, 1, axis=0), lengths, limit)
    return build


def _lengths_one_short(decode_fn):
    def build(plan):
        call = decode_fn(plan)
        return lambda q, k, v, lengths, limit: call(
            q, k, v, jnp.maximum(lengths - 1, 0), limit)
    return build


def _softcap_dropped(decode_fn):
    return lambda plan: decode_fn(dataclasses.replace(plan, softcap=None))


@pytest.mark.parametrize("mutant", [_cache_of_the_previous_example, _lengths_one_short,
                                    _softcap_dropped], ids=lambda m: m.__name__.strip("_"))
def test_the_suites_decode_family_reaches_the_kernel(mutant, tmp_path, monkeypatch):
    """A bug inside the decode path fails `check`'s decode cases and nothing else
    (bfloat16 only, to save time; float32 decode calls take the same path)."""
    import json

    from attn_backend_flash_pallas import _decode_kernel
    from attn_backends_contracts import run_check

    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_decode_kernel, "decode_fn", mutant(_decode_kernel.decode_fn))
    _decode._decode_fn.cache_clear()  # built around the kernel it found
    try:
        with interpret_mode():
            code = run_check(FlashPallasBackend(), str(tmp_path / "cert.json"),
                             ["--attn-only", "decode", "-k", "bfloat16", "-q", "-p",
                              "no:cacheprovider"])
    finally:
        _decode._decode_fn.cache_clear()
    failures = json.loads((tmp_path / "cert.json").read_text())["failures"]
    failed = {f["case"] for f in failures}
    assert code != 0
    assert failed, "the mutant passed the decode family"
    if mutant is _softcap_dropped:
        assert failed == {"decode-q1k600-softcap-b2-bfloat16"}  # the one case with softcap
    else:
        assert failed == {"decode-q1k300-b3-bfloat16", "decode-q4k600-spec-b2-bfloat16",
                          "decode-q1k600-softcap-b2-bfloat16"}
