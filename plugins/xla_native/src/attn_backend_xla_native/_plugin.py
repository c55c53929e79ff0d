"""The ``xla_native`` backend: what it declares, and the lazy call into the kernel."""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends.authoring import (
    CLAIMABLE_DTYPES,
    FEATURES,
    PLATFORMS,
    QUANTIZED_KV_DTYPES,
    AttentionCall,
    Backend,
    HeadsFirstPagedBackend,
    KVCache,
    Operands,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
    distribution_version,
    dropout_keep,
    manifest,
    resolve_options,
)
from attn_backends.contract.environment import platform_name

from ._config import BlockConfig, PagedConfig

#: Platforms BlockConfig has default blocks for.
_BLOCK_PLATFORMS = ("cpu", "gpu", "tpu")


class XlaNativeBackend(Backend, HeadsFirstPagedBackend):
    """Blockwise attention in plain JAX (online softmax, recomputing custom VJP).

    Memory is linear in sequence length forward and backward; work follows
    the visible area (fully hidden blocks under causal, window and kv lengths
    are skipped). ``options``: a :class:`BlockConfig`, or None for
    :meth:`BlockConfig.default_for`.

    Paged calls too (:meth:`attend_paged`), on the ``heads_first`` cache layout
    (K and V each ``[Hkv, num_pages, page_size, D]``), blockwise over pages; their
    ``options``: a :class:`PagedConfig`, or None for
    :meth:`PagedConfig.default_for`.
    """

    name = "xla_native"
    version = distribution_version("attn-backend-xla-native")
    api_version = 1
    capabilities = manifest(
        platforms=PLATFORMS, features=FEATURES, jax_versions=">=0.10,<0.13",
        # float64 too: every softmax and accumulation runs in call.accumulation_dtype.
        dtypes=CLAIMABLE_DTYPES,
        bias_grad=True, differentiable=True, deterministic=True, partitionable=True,
        check_vma=True,
        interpret=False,
        # Quantized K and V: each key block dequantized in the loop, forward only.
        kv_dtypes=QUANTIZED_KV_DTYPES,
    )
    priority = {"cpu": 50, "gpu": 50, "tpu": 50}
    hlo_marker = "xla_native_forward"
    # Any page size, head dim and batch shape (mixed prefill and decode), every
    # dtype as in the dense manifest (float64 in float64); init_cache, write and
    # the canonical round trip are core's heads_first layout's. Every quantized
    # cache: each block of values is dequantized as it is read.
    paged_capabilities = PagedCapabilities(platforms=PLATFORMS, dtypes=CLAIMABLE_DTYPES,
                                           gqa=True, softcap=True, window=True,
                                           check_vma=True, jax_versions=">=0.10,<0.13",
                                           kv_dtypes=QUANTIZED_KV_DTYPES)

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """Blockwise attention; see :class:`attn_backends.Backend`.

        Default blocks follow the platform the program is lowered for
        (``call.platform``), or the host's when the call does not say.
        """

        def default() -> BlockConfig:
            import jax

            platform = call.platform or platform_name(jax.default_backend())
            if platform not in _BLOCK_PLATFORMS:
                platform = "cpu"
            return BlockConfig.default_for(call, platform)

        from ._kernel import blockwise_attention

        blocks = resolve_options(options, BlockConfig, default)
        out, lse = blockwise_attention(call, q, k, v, operands, blocks)
        return (out, lse) if call.return_lse else out

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """Paged attention blockwise over pages; see :class:`attn_backends.PagedBackend`."""
        from ._paged import paged_attention

        config = resolve_options(options, PagedConfig, lambda: PagedConfig.default_for(call))
        return paged_attention(call, q, cache, batch, config)

    def dropout_keep(self, call: AttentionCall, key: Any) -> Any:
        """The keep-mask ``attend`` applies, bool ``[B, Hq, Tq, Tk]``: the bits each
        tile draws from the key and its positions, whatever the blocks."""
        return dropout_keep(call, key)

    def tile_small_options(self, call: AttentionCall) -> BlockConfig:
        """Blocks of 8 and 16 rows, so short calls cross several tiles both ways.

        The forward's key blocks (8) are smaller than its query blocks (16) and
        the backward's the other way round, so the online-softmax rescale, the
        dq sum across key blocks and the dk/dv sums across query blocks all see
        several tiles from 17 tokens on. Ignores ``call``: any length is legal.
        """
        return BlockConfig(block_q=16, block_kv=8, block_q_bwd=8, block_kv_bwd=16)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    """Register the ``xla_native`` backend."""
    return [XlaNativeBackend()]
