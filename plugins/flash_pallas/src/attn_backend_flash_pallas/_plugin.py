"""The ``flash_pallas`` backend: splash attention (Pallas TPU) behind the attn-backends contract.

Importing this module imports no kernel: ``attend`` imports them on first use.
"""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, HeadDims, Operands
from attn_backends.authoring import distribution_version, manifest

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


class FlashPallasBackend(Backend):
    """Splash attention from ``jax.experimental.pallas.ops.tpu``, adapted to BTNH.

    ``options``: a :class:`SplashBlockSizes`, or None for
    ``SplashBlockSizes.default_for(call, device_kind)``.
    """

    name = "flash_pallas"
    version = distribution_version("attn-backend-flash-pallas")
    #: MANIFEST, plus cpu while interpret mode is on.
    capabilities = SWITCH.capabilities(MANIFEST)  # type: ignore[assignment]
    priority = {"tpu": 100, "cpu": 10}
    hlo_marker = "tpu_custom_call"

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


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [FlashPallasBackend()]
