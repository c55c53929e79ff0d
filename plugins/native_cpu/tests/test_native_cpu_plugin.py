"""native_cpu as a plugin: manifest, lazy load, load failures as refusals, threads."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import attn_backends
import jax
import numpy as np
import pytest
from attn_backend_native_cpu import NativeConfig, _library
from attn_backend_native_cpu._plugin import NativeCpuBackend, attn_backends_register

BACKEND = NativeCpuBackend()


def test_manifest() -> None:
    caps = NativeCpuBackend.capabilities
    assert NativeCpuBackend.version == version("attn-backend-native-cpu")
    assert caps.platforms == {"cpu"} and caps.dtypes == {"float32", "bfloat16"}
    assert caps.features == {"gqa", "causal", "window", "lengths", "softcap", "return_lse"}
    assert caps.differentiable and caps.deterministic and not caps.bias_grad
    backends = attn_backends_register()
    assert len(backends) == 1 and isinstance(backends[0], NativeCpuBackend)


def test_import_and_listing_load_no_library() -> None:
    # The library (and its FFI registration) waits for the first call a backend
    # is asked about: importing the registry and listing backends never loads it.
    code = (
        "import attn_backends, attn_backend_native_cpu._plugin as p\n"
        "names = list(attn_backends.registry.backends)\n"
        "assert 'native_cpu' in names, names\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libattn_native_cpu' not in maps, 'library loaded at import'\n"
        "from attn_backend_native_cpu import _library\n"
        "assert _library.load_error() is None\n"
        "assert 'libattn_native_cpu' in open('/proc/self/maps').read()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def broken_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The library path pointing at a file that is not a shared library."""
    fake = tmp_path / _library.LIBRARY_NAME
    fake.write_text("not an ELF file\n")
    monkeypatch.setattr(_library, "library_path", lambda: fake)
    _library.load_error.cache_clear()
    yield fake
    _library.load_error.cache_clear()


def test_a_library_that_fails_to_load_is_a_refusal_with_the_loaders_reason(
        broken_library: Path) -> None:
    spec = jax.ShapeDtypeStruct((1, 8, 2, 16), np.float32)
    verdicts = attn_backends.registry.explain(spec, spec, spec, device="cpu").verdicts
    verdict = next(v for v in verdicts if v.backend == "native_cpu")
    assert not verdict.accepted
    (reason,) = verdict.reasons
    # dlopen's own words, the path, and what to do.
    assert str(broken_library) in reason and "failed to load" in reason
    assert "invalid ELF header" in reason or "file too short" in reason
    assert "reinstall" in reason


def test_a_missing_library_and_a_missing_symbol_are_reasons(tmp_path: Path) -> None:
    assert "is not there" in _library.register(tmp_path / "absent.so")
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if not libc.is_file():
        pytest.skip("no glibc at the Debian path on this machine")
    assert "lacks the FFI handler AttnNativeCpuForward" in _library.register(libc)


def test_config_checks_itself() -> None:
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        NativeConfig(threads=-1)
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        NativeConfig(threads=True)


def test_same_bits_at_one_and_two_threads() -> None:
    # Several query items and key blocks per head, GQA, causal, kv lengths and
    # a window: every item kind and every range edge, forward and backward.
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d = 2, 300, 4, 2, 16
    q = rng.standard_normal((b, t, hq, d), np.float32)
    k = rng.standard_normal((b, t, hkv, d), np.float32)
    v = rng.standard_normal((b, t, hkv, d), np.float32)
    kwargs = dict(causal=True, window=(200, None), kv_lengths=np.array([300, 170]),
                  return_lse=True)
    call, ops = attn_backends.bind(q, k, v, **kwargs)

    def run(threads: int):
        def loss(q, k, v):
            out, lse = BACKEND.attend(call, q, k, v, ops, NativeConfig(threads))
            return (out * out).sum() + np.float32(0.1) * jax.numpy.where(
                jax.numpy.isfinite(lse), lse, 0.0).sum(), (out, lse)

        grads, outs = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x) for x in (*outs, *grads)]

    one, two = run(1), run(2)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), one, two, strict=True):
        assert np.array_equal(a, c, equal_nan=True), name
