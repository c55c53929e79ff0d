"""The splash kernels wrapped in one custom VJP that also differentiates the lse.

Imported lazily (from ``attend``): importing it imports the Pallas TPU kernels.

Why a custom VJP of our own instead of splash's: splash refuses to differentiate
a call that returns its logsumexp ("Higher-order AD not supported"), and its
backward cannot take an lse cotangent. Both are one line of algebra away: with
``dlse`` the logit gradient is ``p * (dp - (di - dlse))``, so the backward runs
splash's own dkv / dq kernels with ``di - dlse`` in place of ``di``. The forward
is splash's public kernel object; only those two backward stages are private
names (checked against jax 0.10.2 and 0.12.0.1, identical signatures there).

Rows that see no key: splash masks with a finite value, so such a row either
averages v over its masked keys or, when every block of the row was skipped,
divides 0 by 0. Both leave an lse far below any real logit (about the mask
value, or -inf); this module turns those rows into zeros with lse -inf, and
gives the backward an lse of 0 there so ``exp(masked - lse)`` is 0, not inf.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from ._config import SplashBlockSizes


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Everything static about one kernel instance (hashable: it keys the cache).

    ``band`` is the (left, right) causal/window band or None; ``offset`` is
    ``Tk - Tq`` of the unpadded call; lengths are the padded ones; ``segmented``
    says whether segment ids are passed; ``interpret`` says whether cpu
    runs the kernels in Pallas' interpreter (TPU always runs them compiled).
    """

    q_len: int
    kv_len: int
    band: tuple[int | None, int | None] | None
    offset: int
    softcap: float | None
    blocks: SplashBlockSizes
    segmented: bool
    interpret: bool

    def mask(self, heads: int) -> Any:
        shape = (self.q_len, self.kv_len)
        if self.band is None:
            head_mask = sm.FullMask(shape)
        elif self.band == (None, 0):
            head_mask = sm.CausalMask(shape, offset=self.offset)
        else:
            head_mask = sm.LocalMask(shape, window_size=self.band, offset=self.offset)
        # One shared object for every head: splash stores a single mask.
        return sm.MultiHeadMask([head_mask] * heads)


@dataclasses.dataclass(frozen=True)
class _Splash:
    kernel: Any
    dq_info: Any
    dkv_info: Any
    mask_value: float
    stage_kwargs: dict[str, Any]


def _splash(plan: KernelPlan, heads: int) -> _Splash:
    """The splash kernel object and backward mask infos for ``heads`` kernel heads.

    Cached per abstract mesh too: the mask infos carry the mesh they were built
    under, and one built outside a ``shard_map`` cannot serve inside one.
    """
    return _splash_on_mesh(plan, heads, jax.sharding.get_abstract_mesh())


@functools.lru_cache(maxsize=64)
def _splash_on_mesh(plan: KernelPlan, heads: int, mesh: Any) -> _Splash:
    """Built eagerly even when first asked for inside a trace: its mask infos are
    concrete arrays, so the cached object can serve later traces without leaking
    tracers."""
    with jax.ensure_compile_time_eval():
        kernel = sk.make_splash_mha(
            plan.mask(heads),
            block_sizes=plan.blocks.to_splash(sk),
            save_residuals=True,
            attn_logits_soft_cap=plan.softcap,
            head_shards=1,
            q_seq_shards=1,
            interpret=plan.interpret,
        )
    mask_value = kernel.kwargs["mask_value"]
    stage_kwargs = dict(
        is_mqa=False,
        mask_value=mask_value,
        attn_logits_soft_cap=plan.softcap,
        mask_function=kernel.kwargs["mask_function"],
        interpret=plan.interpret,
        q_layout=sk.QKVLayout.HEAD_DIM_MINOR,
        k_layout=sk.QKVLayout.HEAD_DIM_MINOR,
        v_layout=sk.QKVLayout.HEAD_DIM_MINOR,
    )
    # Full, causal and local masks are computed in-kernel, so the mask infos
    # carry no partial mask blocks (which splash's wrapper would reshape first).
    return _Splash(kernel, kernel.dq_mask_info, kernel.dkv_mask_info, mask_value, stage_kwargs)


def _per_example(plan: KernelPlan, one: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run ``one(splash, *example_args)`` for every example of the leading batch axis.

    Without segment ids the batch folds into the head axis (splash is per example
    over heads, and query head ``b*Hq + h`` still reads kv head ``b*Hkv + h//G``):
    one kernel launch. Segment ids are per example, so then the examples run
    one after another (``lax.map``). Neither path vmaps the kernel: batching a
    pallas_call adds a grid axis that Pallas' TPU interpret mode rejects (jax
    0.10-0.12), and folding keeps one launch with the kernel's own grid.
    """
    batch, q_heads = args[0].shape[:2]
    if not plan.segmented:
        flat = [x.reshape(batch * x.shape[1], *x.shape[2:]) for x in args]
        outs = one(_splash(plan, batch * q_heads), *flat)
        return tuple(y.reshape(batch, -1, *y.shape[1:]) for y in outs)
    splash = _splash(plan, q_heads)
    return jax.lax.map(lambda xs: one(splash, *xs), args)


def _batch_as_leading(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose ``vmap`` folds the mapped axis into the leading batch axis."""
    wrapped = custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):  # type: ignore[no-untyped-def]
        merged = []
        for x, batched in zip(args, in_batched, strict=True):
            x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            merged.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        outs = wrapped(*merged)
        outs = tuple(y.reshape(axis_size, -1, *y.shape[1:]) for y in outs)
        return outs, tuple(True for _ in outs)

    return wrapped


def _emulated_on_cpu(plan: KernelPlan, one: Callable[..., Any]) -> Callable[..., Any]:
    """``one`` over the batch; with ``plan.interpret`` interpreted on cpu, compiled on tpu.

    ``lax.platform_dependent`` picks the branch when lowering, so turning
    interpret mode on never puts the emulator into a TPU program (nor into a
    ``jax.export`` for TPU).
    """
    if not plan.interpret:
        return lambda *args: _per_example(plan, one, args)
    emulated = dataclasses.replace(plan, interpret=True)
    compiled = dataclasses.replace(plan, interpret=False)
    return lambda *args: jax.lax.platform_dependent(
        *args,
        cpu=lambda *a: _per_example(emulated, one, a),
        default=lambda *a: _per_example(compiled, one, a),
    )


@functools.lru_cache(maxsize=64)
def attention_fn(plan: KernelPlan) -> Callable[..., tuple[Any, Any]]:
    """``f(q, k, v, rows, *ids) -> (out, lse)``, differentiable in q, k, v.

    q ``[B, Hq, Tq, D]`` (already scaled), k ``[B, Hkv, Tk, D]``, v ``[B, Hkv,
    Tk, Dv]``; rows: bool ``[B, Tq]``, False for rows whose output the contract
    zeroes (past ``q_lengths``, padding); ids (only when ``plan.segmented``): q
    ``[B, Tq]``, kv ``[B, Tk]`` int32. out ``[B, Hq, Tq, Dv]`` (q's dtype), lse
    ``[B, Hq, Tq]`` float32; rows that see no key, and rows marked False, give
    zeros and -inf. Both are dead rows for the backward: their cotangents are
    dropped and their (zero) output enters ``di``, so whatever the kernel put
    there (an overflow included) cannot reach dk or dv.
    """

    def forward_one(splash: _Splash, q, k, v, *ids):  # type: ignore[no-untyped-def]
        seg = sk.SegmentIds(q=ids[0], kv=ids[1]) if ids else None
        out, (lse,) = splash.kernel(q, k, v, seg)
        # A real lse is >= a visible logit; one near the mask value (or -inf)
        # means the row saw nothing. NaN compares False: a row that sees a NaN
        # stays NaN.
        dead = lse < 0.5 * splash.mask_value
        out = jnp.where(dead[..., None], jnp.zeros((), out.dtype), out)
        return out, jnp.where(dead, -jnp.inf, lse)

    def backward_one(splash: _Splash, q, k, v, lse, do, di, *ids):  # type: ignore[no-untyped-def]
        seg = sk.SegmentIds(q=ids[0], kv=ids[1]) if ids else None
        blocks = plan.blocks
        dq, dk, dv = sk._splash_attention_bwd_dkv(
            q, k, v, seg, None, lse, do, di,
            bq=blocks.block_q_dkv,
            bkv=blocks.block_kv_dkv,
            bkv_compute=blocks.block_kv_dkv_compute,
            mask_info=splash.dkv_info,
            use_fused_bwd_kernel=blocks.use_fused_bwd_kernel,
            **splash.stage_kwargs,
        )
        if not blocks.use_fused_bwd_kernel:
            dq = sk._splash_attention_bwd_dq(
                q, k, v, seg, None, lse, do, di,
                bq=blocks.block_q_dq,
                bkv=blocks.block_kv_dq,
                mask_info=splash.dq_info,
                **splash.stage_kwargs,
            )
        return dq, dk, dv

    forward = _batch_as_leading(_emulated_on_cpu(plan, forward_one))
    backward = _batch_as_leading(_emulated_on_cpu(plan, backward_one))

    def live_forward(q, k, v, rows, *ids):  # type: ignore[no-untyped-def]
        out, lse = forward(q, k, v, *ids)
        dead = ~rows[:, None, :]
        out = jnp.where(dead[..., None], jnp.zeros((), out.dtype), out)
        return out, jnp.where(dead, -jnp.inf, lse)

    @jax.custom_vjp
    def attend(q, k, v, rows, *ids):  # type: ignore[no-untyped-def]
        return live_forward(q, k, v, rows, *ids)

    def attend_fwd(q, k, v, rows, *ids):  # type: ignore[no-untyped-def]
        out, lse = live_forward(q, k, v, rows, *ids)
        return (out, lse), (q, k, v, out, lse, ids)

    def attend_bwd(res, cotangents):  # type: ignore[no-untyped-def]
        q, k, v, out, lse, ids = res
        d_out, d_lse = cotangents
        dead = jnp.isneginf(lse)
        # Dead rows are constants (zeros, -inf): whatever flows back is dropped.
        d_out = jnp.where(dead[..., None], jnp.zeros((), d_out.dtype), d_out)
        d_lse = jnp.where(dead, 0.0, d_lse.astype(jnp.float32))
        di = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1) - d_lse
        # exp(mask_value - 0) == 0: dead rows add nothing, instead of inf * 0.
        # Their q is zeroed too: with softcap the kernel differentiates tanh of
        # the unmasked q·k, which a huge q would turn into NaN.
        lse_bwd = jnp.where(dead, 0.0, lse)
        q = jnp.where(dead[..., None], jnp.zeros((), q.dtype), q)
        dq, dk, dv = backward(q, k, v, lse_bwd, d_out.astype(q.dtype), di, *ids)
        return (dq, dk, dv, None, *(None for _ in ids))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
