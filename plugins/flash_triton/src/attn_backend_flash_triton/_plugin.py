"""The ``flash_triton`` backend: JAX's Pallas Triton flash attention behind the contract.

Importing this module imports no kernel: ``attend`` imports it on first use.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, Capabilities, HeadDims, Operands

from ._interpret import HOW_TO_ENABLE, interpret_enabled

_DISTRIBUTION = "attn-backend-flash-triton"


@dataclasses.dataclass(frozen=True)
class _TritonCapabilities(Capabilities):
    """A manifest whose cpu rejection says how to turn interpret mode on."""

    def unmet(self, call: AttentionCall, platform: str) -> list[str]:
        reasons = super().unmet(call, platform)
        if platform == "cpu" and "cpu" not in self.platforms:
            reasons = [
                f"{r} (Pallas Triton interpret mode is off: {HOW_TO_ENABLE})"
                if r.startswith("platform ") else r
                for r in reasons
            ]
        return reasons


def _manifest(interpret: bool) -> Capabilities:
    # Exactly what the conformance suite certifies in interpret mode (CI, both
    # jax lines) and what tests/ export for cuda; see the README for the rest.
    return _TritonCapabilities(
        platforms=frozenset({"gpu", "cpu"} if interpret else {"gpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # Triton's dot needs >= 16 along each side; D is padded to a power of
        # two inside the kernel; above 128 the default tiles outgrow shared memory.
        head_dims=HeadDims(max=128, multiple_of=16),
        gqa=True,
        causal=True,
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


class FlashTritonBackend(Backend):
    """``mha`` from ``jax.experimental.pallas.ops.gpu.attention`` (Pallas Triton), BTNH.

    ``options``: a :class:`TritonBlockSizes`, or None for
    ``TritonBlockSizes.default_for(call)``.
    """

    name = "flash_triton"
    version = _version()
    capabilities = _SwitchedManifest()  # type: ignore[assignment]
    priority = {"gpu": 80, "cpu": 10}
    #: The kernel's pallas_call name: in the Triton custom call's config on gpu,
    #: in the interpreted program's op names on cpu; absent from any fallback.
    hlo_marker = "mha_forward"

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
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

    def attend(
        self,
        call: AttentionCall,
        q: Any,
        k: Any,
        v: Any,
        operands: Operands,
        options: Any = None,
    ) -> Any:
        """q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` -> out ``[B, T, Hq, D]``."""
        caps = self.capabilities
        reasons = [f"feature {f!r} not supported" for f in sorted(call.features - caps.features)]
        reasons += self.check(call) + caps.head_dims.reasons(call.head_dim, "head_dim")
        if reasons:
            raise attn_backends.UnsupportedError(
                f"flash_triton cannot serve {call.describe()}: " + "; ".join(reasons)
            )
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


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [FlashTritonBackend()]
