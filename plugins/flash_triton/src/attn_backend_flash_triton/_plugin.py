"""The ``flash_triton`` backend: JAX's Pallas Triton flash attention behind the contract.

Importing this module imports no kernel: ``attend`` imports it on first use.
"""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends.authoring import (
    AttentionCall,
    Backend,
    HeadDims,
    HeadsFirstPagedBackend,
    KVCache,
    Operands,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
    distribution_version,
    jax_api,
    manifest,
    refuse,
    resolve_options,
)

from ._interpret import SWITCH, interpret_enabled

#: The manifest without the cpu that interpret mode adds. Exactly what the
#: conformance suite certifies in interpret mode (CI, both jax lines) and what
#: tests/ export for cuda; see the README for the rest.
MANIFEST = manifest(
    platforms={"gpu"},
    features={"gqa", "causal"},
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    # Triton's dot needs >= 16 along each side; D is padded to a power of
    # two inside the kernel; above 128 the default tiles outgrow shared memory.
    head_dims=HeadDims(max=128, multiple_of=16),
    differentiable=True,
    deterministic=True,
    partitionable=False,
    interpret=True,
    jax_versions=">=0.10,<0.13",
)

#: The paged manifest without the cpu that interpret mode adds (see _paged.py):
#: Triton's block shapes are powers of two and its dot needs 16 per side, and
#: the kernel does not pad D; pages up to 128 positions (a compute block holds
#: at least one page). Mixed prefill and decode batches, GQA, softcap, window.
PAGED_MANIFEST = PagedCapabilities(
    platforms=frozenset({"gpu"}),
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    head_dims=HeadDims(allowed=frozenset({16, 32, 64, 128})),
    page_sizes=frozenset(1 << n for n in range(8)),
    gqa=True, softcap=True, window=True,
    jax_versions=">=0.10,<0.13",
)


class FlashTritonBackend(Backend, HeadsFirstPagedBackend):
    """``mha`` from ``jax.experimental.pallas.ops.gpu.attention`` (Pallas Triton), BTNH.

    ``options``: a :class:`TritonBlockSizes`, or None for
    ``TritonBlockSizes.default_for(call)``.

    Paged calls too (:meth:`attend_paged`): ``paged_attention_kernel`` of
    ``jax.experimental.pallas.ops.gpu.paged_attention`` over a ``heads_first``
    cache (K and V each ``[Hkv, num_pages, page_size, D]``), every query row its
    own kernel sequence; their ``options``: a :class:`TritonPagedBlocks`, or None
    for ``TritonPagedBlocks.default_for``.
    """

    name = "flash_triton"
    version = distribution_version("attn-backend-flash-triton")
    #: MANIFEST, plus cpu while interpret mode is on.
    capabilities = SWITCH.capabilities(MANIFEST)  # type: ignore[assignment]
    priority = {"gpu": 80, "cpu": 10}
    #: The kernel's pallas_call name: in the Triton custom call's config on gpu,
    #: in the interpreted program's op names on cpu; absent from any fallback.
    hlo_marker = "mha_forward"
    #: PAGED_MANIFEST, plus cpu while interpret mode is on.
    paged_capabilities = SWITCH.capabilities(PAGED_MANIFEST)  # type: ignore[assignment]

    def check(self, call: AttentionCall) -> list[str]:
        gone = jax_api.pallas_triton_ops_gone()
        reasons = [gone] if gone else []
        if call.q_len != call.kv_len:
            reasons.append(
                f"Tq={call.q_len} != Tk={call.kv_len}: the kernel's causal mask is top-left "
                "and its fused backward needs as many q as kv blocks, so it serves Tq == Tk only"
            )
        if call.v_head_dim != call.head_dim:
            reasons.append(
                f"v_head_dim={call.v_head_dim} != head_dim={call.head_dim}: the kernel takes "
                "one head dim for q, k and v"
            )
        return reasons

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` -> out ``[B, T, Hq, D]``.

        Core has refused whatever the manifest does not claim before this runs.
        What ``check`` declines (the registry never sends it) is refused here
        too, for code that calls ``attend`` directly: the adapter assumes
        Tq == Tk and Dv == D.
        """
        refuse(self.name, call, self.check(call))
        from ._adapter import run

        return run(call, q, k, v, operands, options)

    def tile_small_options(self, call: AttentionCall) -> Any:
        """The smallest legal Triton tiles (16 everywhere), or None when the default
        for ``call`` already is that (always in interpret mode, and for T <= 16)."""
        from ._config import MIN_BLOCK, TritonBlockSizes

        smallest = TritonBlockSizes(**dict.fromkeys(TritonBlockSizes._BLOCKS, MIN_BLOCK))
        if TritonBlockSizes.default_for(call, interpret_enabled()) == smallest:
            return None
        return smallest

    def check_paged(self, call: PagedCall) -> list[str]:
        gone = jax_api.pallas_triton_ops_gone()
        return [gone] if gone else []

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """Paged attention through the Pallas GPU paged kernel; see
        :class:`attn_backends.PagedBackend`. Default blocks follow the platform the
        program is made for (``call.platform``: cpu runs the interpret row), or the
        interpret switch when the call does not say."""
        from ._config import TritonPagedBlocks
        from ._paged import paged_attention

        interpret = interpret_enabled()
        small = call.platform == "cpu" if call.platform else interpret
        blocks = resolve_options(options, TritonPagedBlocks,
                                 lambda: TritonPagedBlocks.default_for(call.page_size, small))
        return paged_attention(call, q, cache, batch, blocks, interpret)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [FlashTritonBackend()]
