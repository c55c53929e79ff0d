"""The ``flash_pallas`` backend: splash attention (Pallas TPU) behind the attn-backends contract.

Importing this module imports no kernel: ``attend`` imports them on first use.
"""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends import (
    AttentionCall,
    Backend,
    HeadDims,
    KVCache,
    Operands,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
)
from attn_backends.authoring import distribution_version, manifest, resolve_options

from . import _paged
from ._interpret import SWITCH

#: The manifest without the cpu that interpret mode adds. Exactly what
#: tests/test_flash_pallas_*.py exercise (interpret mode on cpu, jax.export for
#: tpu); see the README for why mask and bias are absent.
MANIFEST = manifest(
    platforms={"tpu"},
    features={"gqa", "causal", "window", "segment_ids", "lengths", "softcap", "return_lse"},
    dtypes=frozenset({"float32", "bfloat16"}),
    head_dims=HeadDims(max=256, multiple_of=64),
    differentiable=True,
    partitionable=False,
    interpret=True,
    jax_versions=">=0.10,<0.13",
)


#: The paged manifest: what JAX's ragged paged attention kernel serves on a TPU
#: (``_paged.py`` says why each bound). ``tpu`` only, also with the interpret
#: switch on: neither of JAX's Pallas interpreters runs this kernel.
PAGED_MANIFEST = PagedCapabilities(
    platforms={"tpu"},
    dtypes=frozenset({"float32", "bfloat16"}),
    head_dims=HeadDims(allowed=frozenset({128})),
    page_sizes=frozenset({16, 32, 64, 128, 256}),
    gqa=True, softcap=True, window=True,
    jax_versions=">=0.10,<0.13",
)


class FlashPallasBackend(Backend, PagedBackend):
    """Splash attention from ``jax.experimental.pallas.ops.tpu``, adapted to BTNH.

    ``options``: a :class:`SplashBlockSizes`, or None for
    ``SplashBlockSizes.default_for(call, device_kind)``.

    Paged calls too (:meth:`attend_paged`): JAX's ragged paged attention kernel
    on its own cache layout, ``"kv_combined"``; their ``options``: a
    :class:`RaggedBlockSizes`, or None for the kernel's defaults.
    """

    name = "flash_pallas"
    version = distribution_version("attn-backend-flash-pallas")
    #: MANIFEST, plus cpu while interpret mode is on.
    capabilities = SWITCH.capabilities(MANIFEST)  # type: ignore[assignment]
    priority = {"tpu": 100, "cpu": 10}
    hlo_marker = "tpu_custom_call"
    paged_capabilities = PAGED_MANIFEST

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` -> out (+ lse).

        Core has refused whatever the manifest does not claim (mask, bias,
        float16, other head dims) before this runs.
        """
        from ._adapter import run

        return run(call, q, k, v, operands, options)

    def tile_small_options(self, call: AttentionCall) -> Any:
        """The smallest legal splash blocks (128 everywhere: the TPU lane width).

        None when the call fits in one such tile: there is nothing smaller to
        cut it into, and its default blocks already are that tile.
        """
        from ._config import LANES, SplashBlockSizes

        if max(call.q_len, call.kv_len) <= LANES:
            return None
        return SplashBlockSizes()

    def check_paged(self, call: PagedCall) -> list[str]:
        """The kernel's own rule for how many kv heads it can tile per dtype."""
        return _paged.heads_reasons(call)

    def cache_layout(self, call: PagedCall) -> str:
        return _paged.LAYOUT

    def from_canonical(self, call: PagedCall, k_pages: Any, v_pages: Any) -> KVCache:
        return _paged.from_canonical(call, k_pages, v_pages)

    def to_canonical(self, call: PagedCall, cache: KVCache) -> tuple[Any, Any]:
        return _paged.to_canonical(call, cache)

    def init_cache(self, call: PagedCall, num_pages: int) -> KVCache:
        return _paged.init_cache(call, num_pages)

    def write(self, call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        return _paged.write(call, cache, k, v, slots)

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` through ``ragged_paged_attention``."""
        # None stays None: the kernel's tuned table on a TPU host, else its defaults.
        blocks = None if options is None else resolve_options(
            options, _paged.RaggedBlockSizes, _paged.RaggedBlockSizes)
        return _paged.paged_attention(call, q, cache, batch, blocks)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [FlashPallasBackend()]
