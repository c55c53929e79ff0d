"""The ``native_cpu`` backend: what it declares, and the lazy call into the library."""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends.authoring import (
    QUANTIZED_KV_DTYPES,
    AttentionCall,
    Backend,
    KVCache,
    Operands,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
    distribution_version,
    manifest,
    refuse,
    resolve_options,
)

from ._config import NativeConfig

#: The call features the C++ kernels implement: every one of them leaves each
#: query row one contiguous run of visible keys, which is how the kernels skip work.
FEATURES = ("gqa", "causal", "window", "lengths", "softcap", "return_lse")


class NativeCpuBackend(Backend, PagedBackend):
    """Flash attention in C++ (XLA FFI handlers) on cpu: online softmax over
    key blocks in float32, a recomputing backward, threads over (batch, kv
    head, query block). ``options``: a :class:`NativeConfig` or None.

    The shared library loads at the first call it is asked about (``check``);
    a library that cannot load, or a jax without the FFI API, is a refusal
    whose reason is the loader's, never an error at import.

    Paged calls too (:meth:`attend_paged`), on the canonical cache layout (K and
    V each ``[num_pages, page_size, Hkv, D]``), through the same tiles: each
    sequence's rows read its keys through the page table, block by block.
    """

    name = "native_cpu"
    version = distribution_version("attn-backend-native-cpu")
    api_version = 1
    # The library is built for the machine it is installed on (Linux x86-64 and
    # others GCC or Clang targets); only XLA:CPU runs its handlers.
    capabilities = manifest(platforms={"cpu"}, features=FEATURES,
                            dtypes={"float32", "bfloat16"}, differentiable=True,
                            check_vma=True,
                            deterministic=True, jax_versions=">=0.10,<0.13")
    # Above xla_native (50): in the same runs (BENCHMARKS.md, "native_cpu") it took
    # less time on every dense, decode and paged cpu call measured but one (level).
    priority = {"cpu": 60}
    hlo_marker = "attn_native_cpu_forward"
    # Any page size and head dim, mixed prefill and decode rows; init_cache, write
    # and the canonical round trip are PagedBackend's canonical-layout defaults.
    # Every quantized cache: decode tiles read its int8 or float8 values in place
    # and widen them in registers, prefill tiles dequantize a block at a time.
    paged_capabilities = PagedCapabilities(platforms={"cpu"}, dtypes={"float32", "bfloat16"},
                                           gqa=True, softcap=True, window=True,
                                           check_vma=True, jax_versions=">=0.10,<0.13",
                                           kv_dtypes=QUANTIZED_KV_DTYPES)

    def check(self, call: AttentionCall) -> list[str]:
        """The library's load failure, if any (it loads here, on the first call)."""
        from ._library import load_error

        reason = load_error()
        return [] if reason is None else [reason]

    def check_paged(self, call: PagedCall) -> list[str]:
        """The library's load failure, if any, as for dense calls."""
        from ._library import load_error

        reason = load_error()
        return [] if reason is None else [reason]

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """See :class:`attn_backends.PagedBackend`; ``options`` as for :meth:`attend`."""
        from ._paged import paged_attention

        config = resolve_options(options, NativeConfig, NativeConfig)
        return paged_attention(call, q, cache, batch, config.threads)

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """See :class:`attn_backends.Backend`; refuses what ``check`` declines too."""
        refuse(self.name, call, self.check(call))
        from ._kernel import native_attention

        config = resolve_options(options, NativeConfig, NativeConfig)
        out, lse = native_attention(call, q, k, v, operands, config.threads)
        return (out, lse) if call.return_lse else out


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    """Register the ``native_cpu`` backend."""
    return [NativeCpuBackend()]
