"""The ``cudnn`` backend: cuDNN fused attention (via jax.nn) behind the attn-backends contract.

Importing this module imports neither cuDNN nor a kernel: ``check`` looks for
cuDNN, ``attend`` builds the call.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attn_backends
from attn_backends import AttentionCall, Backend, HeadDims, Operands
from attn_backends.authoring import distribution_version, manifest, refuse

from ._environment import HOW_TO_INSTALL, cudnn_version, local_compute_capability

#: Head dims above this need Hopper (compute capability 9.0) or later.
PRE_HOPPER_MAX_HEAD_DIM = 128

MANIFEST = manifest(
    platforms={"gpu"},
    features={"gqa", "causal", "window", "segment_ids", "lengths", "mask", "bias"},
    # cuDNN's flash attention (what jax.nn calls) takes float16 and bfloat16 only.
    dtypes=frozenset({"bfloat16", "float16"}),
    head_dims=HeadDims(max=256, multiple_of=8),
    # jax.nn asks cuDNN for dbias of any bias shape; which shapes cuDNN really
    # differentiates varies with its version, and none was checked on a GPU here.
    bias_grad=False,
    differentiable=True,
    # cuDNN's backward may accumulate in a nondeterministic order.
    deterministic=False,
    partitionable=False,
    jax_versions=">=0.10,<0.13",
)


class CudnnBackend(Backend):
    """``jax.nn.dot_product_attention(implementation="cudnn")`` with the contract's semantics.

    Takes no ``options``.
    """

    name = "cudnn"
    version = distribution_version("attn-backend-cudnn")
    capabilities = MANIFEST
    priority = {"gpu": 100}
    #: cuDNN's fused-attention custom calls (``__cudnn$fmhaSoftmax``, ...).
    hlo_marker = "__cudnn$fmha"
    #: jax.nn's ``implementation``; a test subclass swaps in "xla" to check the mapping.
    implementation: ClassVar[str] = "cudnn"

    def environment_reasons(self, call: AttentionCall) -> list[str]:
        """What this host lacks for ``call``: cuDNN itself, a GPU generation for large D."""
        reasons = []
        if cudnn_version() is None:
            reasons.append(f"cuDNN not found by JAX: {HOW_TO_INSTALL}")
        if max(call.head_dim, call.v_head_dim) > PRE_HOPPER_MAX_HEAD_DIM:
            capability = local_compute_capability()
            if capability is None:
                reasons.append(
                    f"head_dim={call.head_dim} > {PRE_HOPPER_MAX_HEAD_DIM} needs a Hopper or "
                    "newer GPU (compute capability >= 9.0), and none is visible here"
                )
            elif capability < (9, 0):
                reasons.append(
                    f"head_dim={call.head_dim} > {PRE_HOPPER_MAX_HEAD_DIM} needs compute "
                    f"capability >= 9.0, this GPU has {capability[0]}.{capability[1]}"
                )
        return reasons

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.v_head_dim != call.head_dim:
            reasons.append(
                f"v_head_dim={call.v_head_dim} != head_dim={call.head_dim}: cuDNN's "
                "different-V-dim attention needs cuDNN >= 9.10 on Hopper and is not wired here"
            )
        if call.bias_dtype is not None and call.bias_dtype != call.dtype:
            reasons.append(
                f"bias dtype {call.bias_dtype} != q dtype {call.dtype}: cuDNN adds the bias "
                f"in q's dtype; cast the bias to {call.dtype} to use cudnn"
            )
        return reasons + self.environment_reasons(call)

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """q ``[B, Tq, Hq, D]``, k and v ``[B, Tk, Hkv, D]`` -> out ``[B, Tq, Hq, D]``.

        Core has refused whatever the manifest does not claim before this runs.
        What ``check`` declines (the registry never sends it) is refused here
        too, for code that calls ``attend`` directly, and so are options.
        """
        reasons = self.check(call)
        if options is not None:
            reasons.append(f"options: cudnn takes none, got {type(options).__name__}")
        refuse(self.name, call, reasons)
        from ._adapter import run

        return run(call, q, k, v, operands, self.implementation)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [CudnnBackend()]
