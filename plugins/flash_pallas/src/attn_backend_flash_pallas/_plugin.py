"""The ``flash_pallas`` backend: splash attention (Pallas TPU) behind the attn-backends contract.

Importing this module imports no kernel: ``attend`` imports them on first use.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, Capabilities, HeadDims, Operands

from ._interpret import HOW_TO_ENABLE, interpret_enabled

_DISTRIBUTION = "attn-backend-flash-pallas"


@dataclasses.dataclass(frozen=True)
class _PallasCapabilities(Capabilities):
    """A manifest whose cpu rejection says how to turn interpret mode on."""

    def unmet(self, call: AttentionCall, platform: str) -> list[str]:
        reasons = super().unmet(call, platform)
        if platform == "cpu" and "cpu" not in self.platforms:
            reasons = [
                f"{r} (Pallas TPU interpret mode is off: {HOW_TO_ENABLE})"
                if r.startswith("platform ") else r
                for r in reasons
            ]
        return reasons


def _manifest(interpret: bool) -> Capabilities:
    # Exactly what tests/test_flash_pallas_*.py exercise (interpret mode on cpu,
    # jax.export for tpu); see the README for why mask and bias are absent.
    return _PallasCapabilities(
        platforms=frozenset({"tpu", "cpu"} if interpret else {"tpu"}),
        dtypes=frozenset({"float32", "bfloat16"}),
        head_dims=HeadDims(max=256, multiple_of=64),
        gqa=True,
        causal=True,
        window=True,
        segment_ids=True,
        lengths=True,
        mask=False,
        bias=False,
        bias_grad=False,
        softcap=True,
        return_lse=True,
        differentiable=True,
        deterministic=True,
        partitionable=False,
        interpret=True,
        jax_versions=">=0.10,<0.13",
    )


_MANIFESTS = {flag: _manifest(flag) for flag in (False, True)}


class _SwitchedManifest:
    """``capabilities`` read on the class or an instance: serves cpu only in interpret mode."""

    def __get__(self, obj: object, owner: type | None = None) -> Capabilities:
        return _MANIFESTS[interpret_enabled()]


def _version() -> str:
    try:
        return importlib.metadata.version(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class FlashPallasBackend(Backend):
    """Splash attention from ``jax.experimental.pallas.ops.tpu``, adapted to BTNH.

    ``options``: a :class:`SplashBlockSizes`, or None for
    ``SplashBlockSizes.default_for(call, device_kind)``.
    """

    name = "flash_pallas"
    version = _version()
    capabilities = _SwitchedManifest()  # type: ignore[assignment]
    priority = {"tpu": 100, "cpu": 10}
    hlo_marker = "tpu_custom_call"

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.mask_shape is not None:
            reasons.append(
                "mask: splash takes one static mask shared by the batch, built in numpy at "
                "trace time; a dense boolean mask array cannot be passed (use causal, window, "
                "segment_ids or lengths)"
            )
        if call.bias_shape is not None:
            reasons.append("bias: the splash kernels have no additive bias input")
        if call.dtype not in ("float32", "bfloat16"):
            reasons.append(f"dtype {call.dtype}: the TPU kernels support float32 and bfloat16")
        return reasons

    def attend(
        self,
        call: AttentionCall,
        q: Any,
        k: Any,
        v: Any,
        operands: Operands,
        options: Any = None,
    ) -> Any:
        """q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` -> out (+ lse)."""
        reasons = self.check(call) + self.capabilities.head_dims.reasons(call.head_dim, "head_dim")
        if call.v_head_dim != call.head_dim:
            reasons += self.capabilities.head_dims.reasons(call.v_head_dim, "v_head_dim")
        if reasons:
            raise attn_backends.UnsupportedError(
                f"flash_pallas cannot serve {call.describe()}: " + "; ".join(reasons)
            )
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
