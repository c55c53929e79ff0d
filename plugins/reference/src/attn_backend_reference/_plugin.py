"""Plugin module: declares the reference backend; the math lives in `_dense`."""

from __future__ import annotations

from typing import Any

from attn_backends.authoring import (
    CLAIMABLE_DTYPES,
    FEATURES,
    PLATFORMS,
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
    dropout_keep,
    hookimpl,
    manifest,
)


class ReferenceBackend(Backend, PagedBackend):
    """Dense attention in float32 (float64 for float64 calls): every feature, every
    platform, lowest priority. Paged calls too, on the canonical cache layout."""

    name = "reference"
    version = distribution_version("attn-backend-reference")
    # Every feature on every platform, every dtype (float64 included: it computes
    # in call.accumulation_dtype) and head dim, with every gradient; every
    # quantized K and V (dequantized, forward only).
    capabilities = manifest(platforms=PLATFORMS, features=FEATURES, dtypes=CLAIMABLE_DTYPES,
                            bias_grad=True, differentiable=True, partitionable=True, check_vma=True,
                            jax_versions=">=0.10", kv_dtypes=QUANTIZED_KV_DTYPES)
    priority = {"cpu": 0, "gpu": 0, "tpu": 0}
    # Any page size, head dim and batch shape; init_cache, write and the
    # canonical round trip are PagedBackend's canonical-layout defaults. Every
    # quantized cache (the gathered positions dequantized).
    paged_capabilities = PagedCapabilities(platforms=PLATFORMS, dtypes=CLAIMABLE_DTYPES,
                                           gqa=True, softcap=True, window=True,
                                           check_vma=True, kv_dtypes=QUANTIZED_KV_DTYPES)

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """Dense attention; takes no ``options`` (ignored)."""
        from ._dense import dense_attention

        return dense_attention(call, q, k, v, operands)

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """Gather each sequence's pages, mask, dense softmax; takes no ``options``."""
        from ._paged import paged_attention

        return paged_attention(call, q, cache, batch)

    def dropout_keep(self, call: AttentionCall, key: Any) -> Any:
        """The keep-mask ``attend`` applies: bool ``[B, Hq, Tq, Tk]`` (authoring's rule)."""
        return dropout_keep(call, key)


@hookimpl
def attn_backends_register() -> list[Backend]:
    return [ReferenceBackend()]
