"""The ``example_dense`` backend: its manifest, and the lazy call into ``_kernel``."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, Capabilities, Operands

try:
    _VERSION = metadata.version("attn-backend-example-dense")
except metadata.PackageNotFoundError:  # imported from a source tree that is not installed
    _VERSION = "0+unknown"


class ExampleDenseBackend(Backend):
    """``jax.nn.dot_product_attention`` (XLA implementation) behind the contract.

    Declares only what it implements: no float16, window, segment ids, softcap or lse
    (``jax.nn.dot_product_attention`` has no softcap nor lse, and its own
    causal and window masks are aligned top-left, so causal is built here
    bottom-right as an explicit mask instead).
    """

    name = "example_dense"
    version = _VERSION
    api_version = 1
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "gpu", "tpu"}),
        # No float16: on CPU, XLA's dot_general rejects float16 inputs with a
        # float32 result type (the conformance suite found it).
        dtypes=frozenset({"float32", "bfloat16"}),
        gqa=True,
        causal=True,
        lengths=True,
        mask=True,
        bias=True,
        bias_grad=True,
        differentiable=True,
        deterministic=True,
        jax_versions=">=0.10",
    )
    priority = {"cpu": -10, "gpu": -10, "tpu": -10}

    def check(self, call: AttentionCall) -> list[str]:
        # jax.nn.dot_product_attention needs v's head dim to equal q's and k's.
        if call.v_head_dim != call.head_dim:
            return [f"v_head_dim={call.v_head_dim} must equal head_dim={call.head_dim}"]
        return []

    def attend(
        self,
        call: AttentionCall,
        q: Any,
        k: Any,
        v: Any,
        operands: Operands,
        options: Any = None,
    ) -> Any:
        # The registry never sends an unclaimed feature, but attend may be called
        # directly: refuse rather than silently ignore (the conformance suite checks).
        unclaimed = sorted(call.features - self.capabilities.features)
        if unclaimed:
            raise attn_backends.UnsupportedError(
                f"backend {self.name!r} does not support {', '.join(unclaimed)}"
            )
        from ._kernel import attention

        return attention(call, q, k, v, operands)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [ExampleDenseBackend()]
