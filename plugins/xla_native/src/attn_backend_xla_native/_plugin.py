"""The ``xla_native`` backend: what it declares, and the lazy call into the kernel."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, Capabilities, Operands

from ._config import BlockConfig

try:
    _VERSION = _dist_version("attn-backend-xla-native")
except PackageNotFoundError:  # running from a source tree that is not installed
    _VERSION = "0+unknown"



#: Platforms BlockConfig has default blocks for.
_BLOCK_PLATFORMS = ("cpu", "gpu", "tpu")


class XlaNativeBackend(Backend):
    """Blockwise attention in plain JAX (online softmax, recomputing custom VJP).

    Memory is linear in sequence length forward and backward; work follows
    the visible area (fully hidden blocks under causal, window and kv lengths
    are skipped). ``options``: a :class:`BlockConfig`, or None for
    :meth:`BlockConfig.default_for`.
    """

    name = "xla_native"
    version = _VERSION
    api_version = 1
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
        interpret=False,
        jax_versions=">=0.10,<0.13",
    )
    priority = {"cpu": 50, "gpu": 50, "tpu": 50}
    hlo_marker = "xla_native_forward"

    def attend(
        self,
        call: AttentionCall,
        q: Any,
        k: Any,
        v: Any,
        operands: Operands,
        options: Any = None,
    ) -> Any:
        """Blockwise attention; see :class:`attn_backends.Backend`.

        Default blocks follow the platform the program is lowered for
        (``call.platform``), or the host's when the call does not say.
        """
        if options is None:
            import jax

            platform = call.platform or attn_backends.platform_name(jax.default_backend())
            options = BlockConfig.default_for(call, platform if platform in _BLOCK_PLATFORMS else "cpu")
        elif not isinstance(options, BlockConfig):
            raise ValueError(
                f"xla_native: options must be an attn_backend_xla_native.BlockConfig "
                f"or None, got {type(options).__name__}"
            )
        from ._kernel import blockwise_attention

        out, lse = blockwise_attention(call, q, k, v, operands, options)
        return (out, lse) if call.return_lse else out

    def tile_small_options(self, call: AttentionCall) -> BlockConfig:
        """Blocks of 8 and 16 rows, so short calls cross several tiles both ways.

        The forward's key blocks (8) are smaller than its query blocks (16) and
        the backward's the other way round, so the online-softmax rescale, the
        dq sum across key blocks and the dk/dv sums across query blocks all see
        several tiles from 17 tokens on. Ignores ``call``: any length is legal.
        """
        return BlockConfig(block_q=16, block_kv=8, block_q_bwd=8, block_kv_bwd=16)


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    """Register the ``xla_native`` backend."""
    return [XlaNativeBackend()]
