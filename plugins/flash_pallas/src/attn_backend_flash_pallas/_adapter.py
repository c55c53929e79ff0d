"""The mapping from a contract call (BTNH) to the splash kernels ([B, H, T, D]) and back.

Steps: zero what no live row may see (``_sanitize``), pre-scale q (splash
does not scale; softcap then applies to ``scale * q·k`` as the contract says),
pad Tq and Tk to the block multiples, move heads before time, build the band
and the segment ids, run the kernel (rows past ``q_lengths`` and the padding
marked dead), then cut the padding and restore BTNH.
"""

from __future__ import annotations

from typing import Any

from attn_backends import AttentionCall, Operands
from attn_backends.authoring import resolve_options

from . import _masks, _sanitize
from ._config import SplashBlockSizes
from ._interpret import interpret_enabled


def local_tpu_kind() -> str | None:
    """``device_kind`` of this host's first TPU, or None without one (e.g. exporting)."""
    import jax

    try:
        return jax.local_devices(backend="tpu")[0].device_kind
    except RuntimeError:
        return None


def resolve_blocks(call: AttentionCall, options: Any, interpret: bool) -> SplashBlockSizes:
    """``options`` when given (must be a :class:`SplashBlockSizes`), else the default.

    The default follows this host's TPU; without one it is the generic TPU row,
    or the small interpret row when interpret mode is on.
    """

    def default() -> SplashBlockSizes:
        kind = local_tpu_kind()
        return SplashBlockSizes.default_for(call, "cpu" if kind is None and interpret else kind)

    return resolve_options(options, SplashBlockSizes, default)


def run(call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands, options: Any) -> Any:
    """Attention for a validated call; q ``[B, Tq, Hq, D]`` -> out ``[B, Tq, Hq, Dv]`` (+ lse).

    Decode calls (see ``_decode.declines``) run JAX's paged-attention kernel when
    only evaluated, and splash when differentiated; every other call runs splash.
    """
    from . import _decode

    interpret = interpret_enabled()
    blocks = resolve_blocks(call, options, interpret)
    if not _decode.declines(call):

        def splash(q: Any, k: Any, v: Any, operands: Operands) -> Any:
            return _splash(call, q, k, v, operands, blocks, interpret)

        return _decode.run(call, q, k, v, operands, splash, interpret)
    return _splash(call, q, k, v, operands, blocks, interpret)


def _splash(
    call: AttentionCall,
    q: Any,
    k: Any,
    v: Any,
    operands: Operands,
    blocks: SplashBlockSizes,
    interpret: bool,
) -> Any:
    """The splash path: out ``[B, Tq, Hq, Dv]`` (+ lse)."""
    import jax.numpy as jnp

    from . import _kernel

    tq_pad, tk_pad = blocks.padded(call)

    def to_kernel(x: Any, length: int) -> Any:
        # [B, T, H, D] -> [B, H, T_pad, D]; padded rows/keys are zeros, masked later.
        x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3)

    k, v = _sanitize.hide_keys(call, k, v, operands)
    q_scaled = q * jnp.asarray(call.scale, q.dtype)
    # Rows past q_lengths and the padding are dead rows of the kernel function.
    rows = jnp.pad(_sanitize.live_rows(call, operands), ((0, 0), (0, tq_pad - call.q_len)))
    ids: tuple[Any, ...] = ()
    if _masks.needs_segment_ids(call, tk_pad):
        ids = _masks.segment_ids(call, operands, tq_pad, tk_pad)
    plan = _kernel.KernelPlan(
        q_len=tq_pad,
        kv_len=tk_pad,
        band=_masks.static_window(call),
        offset=call.offset,
        softcap=call.softcap,
        blocks=blocks,
        segmented=bool(ids),
        interpret=interpret,
    )
    out, lse = _kernel.attention_fn(plan)(
        to_kernel(q_scaled, tq_pad), to_kernel(k, tk_pad), to_kernel(v, tk_pad), rows, *ids
    )
    out = out[:, :, : call.q_len].transpose(0, 2, 1, 3)
    lse = lse[:, :, : call.q_len]
    return (out, lse) if call.return_lse else out
