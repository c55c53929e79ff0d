"""The ``flash_triton`` backend: JAX's Pallas Triton flash attention behind the contract.

Importing this module imports no kernel: ``attend`` imports it on first use.
"""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, HeadDims, Operands
from attn_backends.authoring import distribution_version, manifest, refuse

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


class FlashTritonBackend(Backend):
    """``mha`` from ``jax.experimental.pallas.ops.gpu.attention`` (Pallas Triton), BTNH.

    ``options``: a :class:`TritonBlockSizes`, or None for
    ``TritonBlockSizes.default_for(call)``.
    """

    name = "flash_triton"
    version = distribution_version("attn-backend-flash-triton")
    #: MANIFEST, plus cpu while interpret mode is on.
    capabilities = SWITCH.capabilities(MANIFEST)  # type: ignore[assignment]
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


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [FlashTritonBackend()]
