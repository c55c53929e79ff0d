"""attn-backend-native-cpu: flash attention in C++ through XLA's FFI, for CPU.

Importing this package loads nothing native: the shared library is loaded, and
its FFI targets registered, at the first call the backend is asked to serve
(:func:`attn_backend_native_cpu._library.load_error`).
"""

from ._config import NativeConfig

__all__ = ["NativeConfig"]
