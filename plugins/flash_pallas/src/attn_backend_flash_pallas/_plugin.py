"""The ``flash_pallas`` backend: splash attention (Pallas TPU) behind the attn-backends contract.

Importing this module imports no kernel: ``attend`` imports them on first use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attn_backends
from attn_backends.authoring import (
    QUANTIZED_KV_DTYPES,
    AttentionCall,
    Backend,
    HeadDims,
    KVCache,
    Operands,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
    SwitchedManifest,
    distribution_version,
    heads_first,
    manifest,
    resolve_options,
)

from . import _paged, _paged_decode, _paged_quantized
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


#: The paged manifest on a TPU: what JAX's ragged paged attention kernel serves
#: (``_paged.py`` says why each bound); decode-only bfloat16 calls go to its
#: paged_attention kernel instead (``_paged_decode.py``), within the same bounds;
#: decode steps over a quantized cache to this plugin's own kernel
#: (``_paged_quantized.py``), the other quantized calls declined by check_paged.
PAGED_MANIFEST = PagedCapabilities(
    platforms={"tpu"},
    dtypes=frozenset({"float32", "bfloat16"}),
    head_dims=HeadDims(allowed=frozenset({128})),
    page_sizes=frozenset({16, 32, 64, 128, 256}),
    gqa=True, softcap=True, window=True,
    kv_dtypes=frozenset(QUANTIZED_KV_DTYPES),
    jax_versions=">=0.10,<0.13",
)

#: Why a paged call that only the ragged kernel serves cannot run on cpu.
RAGGED_NOT_INTERPRETED = (
    "the ragged kernel (layout 'kv_combined') serving this call does not run in "
    "Pallas' interpreters (TPU interpret mode: \"'ReshapeTransform' object has no "
    "attribute 'indices'\"; interpret=True: \"'TypedInt' object has no attribute "
    "'shape'\"): tpu only")


@dataclasses.dataclass(frozen=True)
class _InterpretedPagedCapabilities(PagedCapabilities):
    """The paged manifest as the interpret switch sees it: on cpu only the decode
    path (JAX's paged_attention, which runs in TPU interpret mode) serves."""

    def unmet(self, call: PagedCall, platform: str) -> list[str]:
        reasons = super().unmet(call, platform)
        if platform != "cpu":
            return reasons
        if call.quantized:
            declined = _paged_quantized.declines(call)
            if declined:
                return reasons + declined
        elif declined := _paged_decode.declines(call):
            return reasons + [RAGGED_NOT_INTERPRETED, *declined]
        if "cpu" not in self.platforms:
            return [f"{r} ({SWITCH.off_note})" if r.startswith("platform ") else r
                    for r in reasons]
        return reasons


def _switched_paged(base: PagedCapabilities) -> SwitchedManifest:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    off = _InterpretedPagedCapabilities(**fields)
    on = _InterpretedPagedCapabilities(**{**fields, "platforms": base.platforms | {"cpu"}})
    return SwitchedManifest(SWITCH, off, on)  # type: ignore[arg-type]


class FlashPallasBackend(Backend, PagedBackend):
    """Splash attention from ``jax.experimental.pallas.ops.tpu``, adapted to BTNH.

    ``options``: a :class:`SplashBlockSizes`, or None for
    ``SplashBlockSizes.default_for(call, device_kind)``.

    Paged calls too (:meth:`attend_paged`): decode-only bfloat16 calls
    (``max_q_len=1``, no window) through JAX's ``paged_attention`` on the
    ``"heads_first"`` layout (also on cpu in interpret mode), every other one
    through JAX's ragged paged attention kernel on ``"kv_combined"`` (tpu only);
    their ``options``: a :class:`RaggedBlockSizes`, or None for the kernels'
    defaults. Decode steps over a quantized cache (int8, float8) through this
    plugin's own kernel on ``"heads_first"`` (also on cpu in interpret mode).
    """

    name = "flash_pallas"
    version = distribution_version("attn-backend-flash-pallas")
    #: MANIFEST, plus cpu while interpret mode is on.
    capabilities = SWITCH.capabilities(MANIFEST)  # type: ignore[assignment]
    priority = {"tpu": 100, "cpu": 10}
    hlo_marker = "tpu_custom_call"
    #: PAGED_MANIFEST, plus cpu for the decode path while interpret mode is on.
    paged_capabilities = _switched_paged(PAGED_MANIFEST)  # type: ignore[assignment]

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
        """The ragged kernel's own rule for how many kv heads it can tile per
        dtype (the decode kernel takes any group); a quantized cache is read by
        decode steps only."""
        if call.quantized:
            return _paged_quantized.declines(call)
        return [] if self._decodes(call) else _paged.heads_reasons(call)

    @staticmethod
    def _decodes(call: PagedCall) -> bool:
        return call.quantized or not _paged_decode.declines(call)

    def _layout(self, call: PagedCall) -> Any:
        return heads_first if self._decodes(call) else _paged

    def cache_layout(self, call: PagedCall) -> str:
        """``"heads_first"`` for calls the decode kernels serve, else ``"kv_combined"``."""
        return str(self._layout(call).LAYOUT)

    def from_canonical(self, call: PagedCall, k_pages: Any, v_pages: Any,
                       *scales: Any) -> KVCache:
        return self._layout(call).from_canonical(call, k_pages, v_pages, *scales)

    def to_canonical(self, call: PagedCall, cache: KVCache) -> tuple[Any, ...]:
        return self._layout(call).to_canonical(call, cache)

    def init_cache(self, call: PagedCall, num_pages: int) -> KVCache:
        return self._layout(call).init_cache(call, num_pages)

    def write(self, call: PagedCall, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        return self._layout(call).write(call, cache, k, v, slots)

    def attend_paged(self, call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                     options: Any = None) -> Any:
        """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` through the quantized decode kernel,
        ``paged_attention`` (decode calls) or ``ragged_paged_attention``."""
        # None stays None: the ragged kernel's tuned table on a TPU host, else its defaults.
        blocks = None if options is None else resolve_options(
            options, _paged.RaggedBlockSizes, _paged.RaggedBlockSizes)
        if call.quantized:
            emulated = call.platform == "cpu" and SWITCH.enabled()
            return _paged_quantized.paged_attention(call, q, cache, batch, emulated)
        if self._decodes(call):
            pages = (blocks or _paged.RaggedBlockSizes()).kv_pages_per_block
            return _paged_decode.paged_attention(call, q, cache, batch, pages)
        return _paged.paged_attention(call, q, cache, batch, blocks)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [FlashPallasBackend()]
