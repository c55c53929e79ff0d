"""The cudnn backend's mapping, run through jax.nn's XLA implementation instead of cuDNN.

``jax.nn.dot_product_attention`` promises the same result from
``implementation="xla"`` and ``"cudnn"`` for what both accept, so this stand-in
checks everything the adapter adds (bottom-right causal, windows and segment
ids as a mask, empty rows, odd-length padding, query lengths) on a machine
without cuDNN. It cannot check cuDNN itself: ``make test-gpu`` does, on a GPU.
"""

from __future__ import annotations

import dataclasses

from attn_backend_cudnn import CudnnBackend
from attn_backends import AttentionCall


class CudnnMappingOnXla(CudnnBackend):
    """``cudnn`` with jax.nn's XLA implementation underneath; serves cpu for the suite."""

    # XLA on CPU has no float16 dot with float32 accumulation (what jax.nn's
    # XLA path asks for), so the stand-in checks the mapping in bfloat16 only.
    capabilities = dataclasses.replace(CudnnBackend.capabilities,
                                       platforms=frozenset({"cpu", "gpu"}),
                                       dtypes=frozenset({"bfloat16"}))
    hlo_marker = None
    implementation = "xla"

    def environment_reasons(self, call: AttentionCall) -> list[str]:
        del call  # XLA needs neither cuDNN nor a GPU generation
        return []
