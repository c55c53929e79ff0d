"""The mapping from a contract call (BTNH) to the Pallas Triton kernel and back.

Imported lazily (from ``attend``): importing it imports the kernel module.

The kernel ``mha(q, k, v, segment_ids, sm_scale, causal, block_sizes, ...)``
takes BTNH itself, so the adapter only: repeats kv heads for GQA (the kernel
reads head h of q, k and v together; the repeat's VJP sums dk/dv per group);
pads T up to the block multiple with zero rows; masks padded keys, with the
kernel's causal mask where it already hides them (a padded key sits after
every real query), else with a segment id of 1 that only padded rows share;
and cuts the padding off the output. The kernel's causal mask is top-left,
``j <= i``, which is the contract's bottom-right one because Tq == Tk here.
"""

from __future__ import annotations

import functools
from typing import Any

from attn_backends import AttentionCall, Operands
from attn_backends.authoring import jax_api, resolve_options

from ._config import TritonBlockSizes
from ._interpret import interpret_enabled


def kernel_module() -> Any:
    """``jax.experimental.pallas.ops.gpu.attention`` (jax < 0.12: see ``check``)."""
    return jax_api.pallas_triton_ops("attention")


def resolve_blocks(call: AttentionCall, options: Any, interpret: bool) -> TritonBlockSizes:
    """``options`` when given (must be a :class:`TritonBlockSizes`), else the default."""
    return resolve_options(options, TritonBlockSizes,
                           lambda: TritonBlockSizes.default_for(call, interpret))


def _kernel(call: AttentionCall, blocks: TritonBlockSizes, interpret: bool) -> Any:
    """``f(q, k, v, ids) -> out``: the kernel, interpreted on cpu when ``interpret``.

    ``lax.platform_dependent`` picks the branch when lowering, so interpret mode
    never puts the emulator into a GPU program (nor into a ``jax.export`` for cuda).
    """
    import jax

    module = kernel_module()
    run = functools.partial(
        module.mha,
        sm_scale=float(call.scale),
        causal=call.causal,
        block_sizes=blocks.to_kernel(module),
        backward_pass_impl="triton",
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    if not interpret:
        return lambda q, k, v, ids: run(q, k, v, ids)
    return lambda q, k, v, ids: jax.lax.platform_dependent(
        q, k, v, ids,
        cpu=lambda *a: run(*a, interpret=True),
        default=lambda *a: run(*a, interpret=False),
    )


def run(call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands, options: Any) -> Any:
    """Attention for a call ``check()`` accepted; q ``[B, T, Hq, D]`` -> out ``[B, T, Hq, D]``."""
    import jax.numpy as jnp

    del operands  # the manifest claims no operand-carrying feature
    interpret = interpret_enabled()
    blocks = resolve_blocks(call, options, interpret)
    length = call.q_len
    padded = blocks.padded(length)

    def prepare(x: Any, kv: bool) -> Any:
        if kv and call.group > 1:
            x = jnp.repeat(x, call.group, axis=2)
        return jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))

    ids = None
    if padded > length and not call.causal:
        # Real rows and keys share id 0; padded keys hold 1, seen only by padded rows.
        ids = jnp.broadcast_to((jnp.arange(padded) >= length).astype(jnp.int32),
                               (call.batch, padded))
    out = _kernel(call, blocks, interpret)(
        prepare(q, kv=False), prepare(k, kv=True), prepare(v, kv=True), ids
    )
    return out[:, :length]
