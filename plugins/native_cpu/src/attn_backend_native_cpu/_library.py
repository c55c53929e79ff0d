"""The shared library: found, loaded and its FFI targets registered once, at first use.

Nothing here runs at import. :func:`load_error` is what ``check`` reports: None
once both targets are registered with XLA, else the loader's own reason (a
missing file, ``dlopen``'s message, a missing symbol, a jaxlib without the FFI
API), so the registry refuses the call with it and selects another backend.
"""

from __future__ import annotations

import ctypes
import functools
import os
from importlib import resources
from pathlib import Path

#: The file CMakeLists.txt installs into the package.
LIBRARY_NAME = "libattn_native_cpu.so"
#: (exported C symbol, FFI target name) of each handler.
TARGETS = {
    "forward": ("AttnNativeCpuForward", "attn_native_cpu_forward"),
    "backward": ("AttnNativeCpuBackward", "attn_native_cpu_backward"),
    "paged": ("AttnNativeCpuPaged", "attn_native_cpu_paged"),
    "paged_quantized": ("AttnNativeCpuPagedQuantized", "attn_native_cpu_paged_quantized"),
}
HOW_TO_BUILD = ("reinstall the distribution so it compiles (pip install --force-reinstall "
                "attn-backend-native-cpu, or ./plugins/native_cpu from a checkout; needs a "
                "C++17 compiler and CMake >= 3.18)")


def library_path() -> Path:
    """Where the library is: beside this module in a wheel install, or in the
    editable install's build tree (scikit-build-core maps it into the package)."""
    return Path(str(resources.files(__package__).joinpath(LIBRARY_NAME)))


#: The kernels the library may run, least to most: ATTN_NATIVE_CPU_ISA caps the
#: choice at one of them (unset: the best this CPU has; dispatch.cc).
ISA_CAPS = ("baseline", "x86-64-v3", "avx512-bf16")


@functools.cache
def load_error() -> str | None:
    """Load the library and register its targets on cpu: None on success, else why not.

    Cached: the first call does the work (and a failure is not retried, so every
    later call reports the same reason without touching the loader again).
    """
    cap = os.environ.get("ATTN_NATIVE_CPU_ISA", "")
    if cap.strip() and cap not in ISA_CAPS:  # blank is unset, as for core's variables
        return (f"ATTN_NATIVE_CPU_ISA: expected one of {', '.join(ISA_CAPS)} (the most the "
                f"kernels may use; unset: the best this CPU has), got {cap!r}")
    return register(library_path())


def register(path: Path) -> str | None:
    """Load the library at ``path`` and register its FFI targets for cpu."""
    try:
        import jax
        from attn_backends.authoring import jax_api

        missing = jax_api.ffi_missing()
    except ImportError as error:
        return f"jax.ffi is not importable here ({error}); native_cpu needs jax >= 0.10"
    if missing:
        return (f"the installed jax {jax.__version__} lacks jax.ffi.{', jax.ffi.'.join(missing)}; "
                "native_cpu needs jax >= 0.10")
    if not path.is_file():
        return f"native library {path} is not there (the build did not run); {HOW_TO_BUILD}"
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        return f"native library {path} failed to load: {error}; {HOW_TO_BUILD}"
    for symbol, target in TARGETS.values():
        try:
            handler = getattr(library, symbol)
        except AttributeError as error:
            return f"native library {path} lacks the FFI handler {symbol} ({error}); {HOW_TO_BUILD}"
        try:
            jax_api.register_ffi_target(target, handler, platform="cpu")
        except Exception as error:  # noqa: BLE001 - reported as the refusal's reason
            return (f"jaxlib {jax.__version__} refused to register the FFI target {target}: "
                    f"{type(error).__name__}: {error}")
    return None


def kernel_isa() -> str:
    """The kernels this process runs, one of :data:`ISA_CAPS`: ``"avx512-bf16"``
    (x86-64-v3's, and the dense bfloat16 forward by AVX512_BF16's bfloat16
    products), ``"x86-64-v3"`` (AVX2 + FMA) or ``"baseline"``. The library
    picks once, by the CPU's features and ATTN_NATIVE_CPU_ISA; loads it."""
    reason = load_error()
    if reason is not None:
        raise RuntimeError(f"native_cpu: {reason}")
    query = ctypes.CDLL(str(library_path())).AttnNativeCpuKernelIsa
    query.restype = ctypes.c_char_p
    return query().decode()
