"""Plugin module: declares the reference backend; the math lives in `_dense`."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from attn_backends import AttentionCall, Backend, Capabilities, Operands, hookimpl


class ReferenceBackend(Backend):
    """Dense attention in float32: every feature, every platform, lowest priority."""

    name = "reference"
    version = metadata.version("attn-backend-reference")
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "gpu", "tpu"}),
        gqa=True,
        causal=True,
        window=True,
        segment_ids=True,
        lengths=True,
        mask=True,
        bias=True,
        bias_grad=True,
        softcap=True,
        return_lse=True,
        differentiable=True,
        deterministic=True,
        partitionable=True,
        jax_versions=">=0.10",
    )
    priority = {"cpu": 0, "gpu": 0, "tpu": 0}

    def attend(
        self,
        call: AttentionCall,
        q: Any,
        k: Any,
        v: Any,
        operands: Operands,
        options: Any = None,
    ) -> Any:
        from ._dense import dense_attention

        return dense_attention(call, q, k, v, operands)


@hookimpl
def attn_backends_register() -> list[Backend]:
    return [ReferenceBackend()]
