"""native_cpu's dense bfloat16 forward by bfloat16 products (AVX512_BF16's
vdpbf16ps, csrc/bf16_forward.cc): chosen by the CPU's features, capped by
ATTN_NATIVE_CPU_ISA, and judged against the float64 oracle on shapes with
several query tiles, key blocks and pairs, padded head dims and garbage past
each row's keys (the conformance suite's cases are a tile or two)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_native_cpu import NativeConfig, _library
from attn_backend_native_cpu._plugin import NativeCpuBackend
from attn_backends.oracle import attention

BACKEND = NativeCpuBackend()
AVX512_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _isa_in_a_process(cap: str | None) -> str:
    env = {n: x for n, x in os.environ.items() if n != "ATTN_NATIVE_CPU_ISA"}
    if cap is not None:
        env["ATTN_NATIVE_CPU_ISA"] = cap
    code = "from attn_backend_native_cpu import _library; print(_library.kernel_isa())"
    return subprocess.run([sys.executable, "-c", code], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_kernels_follow_the_cpus_features_and_the_cap() -> None:
    best = "avx512-bf16" if AVX512_BF16 <= _cpu_flags() else "x86-64-v3"
    assert _isa_in_a_process(None) == best
    assert _isa_in_a_process("x86-64-v3") == "x86-64-v3"
    assert _isa_in_a_process("baseline") == "baseline"


def test_an_unknown_cap_is_a_refusal_that_names_the_choices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTN_NATIVE_CPU_ISA", "avx512")
    _library.load_error.cache_clear()
    try:
        reason = _library.load_error()
    finally:
        monkeypatch.delenv("ATTN_NATIVE_CPU_ISA")
        _library.load_error.cache_clear()
    assert reason is not None and reason.startswith("ATTN_NATIVE_CPU_ISA: expected one of "
                                                    "baseline, x86-64-v3, avx512-bf16")
    assert reason.endswith("got 'avx512'")


# (batch, tq, tk, hq, hkv, d, dv, keyword arguments): 300 query rows are five
# tiles of 64 (GQA 6:2: 21 positions a tile), 333 keys three blocks of 128 (the
# last partial, an odd count: a pair straddling kv_length); a window of 151
# keys starts tiles at odd keys; d 40 pads to 48 lanes of V, d 33 is odd (its
# last pair half zero).
CASES = {
    "causal-gqa-lengths": (2, 300, 333, 6, 2, 40, 40,
                           dict(causal=True, kv_lengths=np.array([333, 201]))),
    "window-q-lengths": (2, 300, 300, 4, 4, 64, 64,
                         dict(causal=True, window=(151, None), q_lengths=np.array([300, 77]))),
    "odd-dims-softcap": (1, 130, 257, 2, 1, 33, 33, dict(softcap=4.0)),
    "dv-differs": (1, 200, 200, 4, 2, 64, 128, dict(causal=True, window=(None, 20))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_bf16_forward_matches_the_oracle(name: str) -> None:
    b, tq, tk, hq, hkv, d, dv, kwargs = CASES[name]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d)) * 2, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, tk, hkv, d)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, tk, hkv, dv)), jnp.bfloat16)
    call, ops = attn_backends.bind(q, k, v, return_lse=True, **kwargs)

    def run(k, v, threads):
        f = jax.jit(lambda q, k, v: BACKEND.attend(call, q, k, v, ops, NativeConfig(threads)))
        return [np.asarray(x, np.float64) for x in f(q, k, v)]

    out, lse = run(k, v, 1)
    want_out, want_lse = attention(*(np.asarray(x, np.float64) for x in (q, k, v)), **kwargs)
    # bfloat16 outputs: half a unit in the last place of values up to ~3 (2^-8 x 2),
    # with the weights' rounding to bfloat16 below it.
    np.testing.assert_allclose(out, want_out, atol=1.6e-2, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=0)
    out2, lse2 = run(k, v, 2)
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
    if "kv_lengths" in kwargs:  # garbage past each row's keys never reaches the output
        bad = np.arange(tk)[None, :] >= kwargs["kv_lengths"][:, None]
        k_bad = jnp.where(bad[:, :, None, None], jnp.nan, k)
        v_bad = jnp.where(bad[:, :, None, None], jnp.inf, v)
        out3, lse3 = run(k_bad, v_bad, 2)
        assert np.array_equal(out, out3) and np.array_equal(lse, lse3)
