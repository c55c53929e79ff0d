"""The ``example_dense`` backend: its manifest, and the lazy call into ``_kernel``."""

from __future__ import annotations

from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, Operands
from attn_backends.authoring import distribution_version, manifest


class ExampleDenseBackend(Backend):
    """``jax.nn.dot_product_attention`` (XLA implementation) behind the contract.

    Declares only what it implements: no float16, window, segment ids, softcap or lse
    (``jax.nn.dot_product_attention`` has no softcap nor lse, and its own
    causal and window masks are aligned top-left, so causal is built here
    bottom-right as an explicit mask instead).
    """

    name = "example_dense"
    # "0+unknown" when run from a source tree that is not installed.
    version = distribution_version("attn-backend-example-dense")
    api_version = 1
    capabilities = manifest(
        platforms={"cpu", "gpu", "tpu"},
        features={"gqa", "causal", "lengths", "mask", "bias"},
        # No float16: on CPU, XLA's dot_general rejects float16 inputs with a
        # float32 result type (the conformance suite found it).
        dtypes=frozenset({"float32", "bfloat16"}),
        bias_grad=True,
        differentiable=True,
        deterministic=True,
        # Plain jnp: it runs inside a user's shard_map with check_vma=True.
        check_vma=True,
        jax_versions=">=0.10",
    )
    priority = {"cpu": -10, "gpu": -10, "tpu": -10}

    def check(self, call: AttentionCall) -> list[str]:
        # jax.nn.dot_product_attention needs v's head dim to equal q's and k's.
        if call.v_head_dim != call.head_dim:
            return [f"v_head_dim={call.v_head_dim} must equal head_dim={call.head_dim}"]
        return []

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        # Core refuses a call this manifest does not claim (a feature, dtype,
        # head dim or platform) before attend runs, so only claimed features
        # arrive here. The conformance suite checks that refusal, through the
        # registry, for each feature, dtype and platform the manifest leaves out
        # (its "unclaimed" family).
        from ._kernel import attention

        return attention(call, q, k, v, operands)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [ExampleDenseBackend()]
