"""Ring attention on one device's shard (inside ``shard_map``), with its own VJP.

Each of the P devices on the ring axis holds a slice of the queries and of the
keys/values. Step s computes attention of the local queries against the kv
block that started on device ``(r - s) mod P`` (one call of the selected
backend with ``return_lse=True``), merges it into the running result by the
lse, and passes the kv block on with ``ppermute`` at the start of the next
step, one sub-chunk at a time written back in place, so a single sub-chunk
is in flight. P - 1 block transfers in all. (Sending the next block during
the step's compute would overlap transfer and compute, at the price of a
second kv buffer; memory was the constraint here.)

Causal calls use the zigzag order (``ring_run`` reorders the sequence first):
the sequence is cut in 2P chunks and device r holds chunks r and 2P-1-r, so
every device does the same work at every step. Work is done in sub-chunk
pairs (each chunk cut in ``splits`` sub-chunks), each one backend call of one
of two static signatures: ``full`` (no mask) or ``diag`` (a sub-chunk against
itself: plain causal). On its own block a device visits the pairs b < a (full)
and b == a (diag), in local sub-chunk indices, since local order is global
order there. A block from a lower device is seen whole by both query chunks
through its first chunk only (the second is later than both); a block from a
higher device is seen only by the second query chunk, whole. Both are 2n^2
full pairs, chosen by a table index, not a branch. Without causal, every step
visits all pairs. kv_lengths become per-sub-chunk lengths ``clip(kv_lengths -
start, 0, L)``. Small calls keep the backend's own temporaries (transposed
copies of its inputs) small, and the accumulators are updated in place.

The backward pass runs the ring again: for each block it recomputes the
block's (out_b, lse_b) with ``jax.vjp`` of the backend and pulls back the
cotangents the merge implies, ``d out_b = w_b dO`` and ``d lse_b = w_b (dlse +
<dO, out_b> - <dO, O>)`` with ``w_b = exp(lse_b - lse)``; that is exactly the
global softmax gradient restricted to the block. dk and dv travel with their
block and take one last step home (P transfers of the float32 pair).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..contract.call import AttentionCall, Operands

#: ``attend(call, q, k, v, operands) -> (out, lse)``: the backend, per block.
Attend = Callable[[AttentionCall, Any, Any, Any, Operands], tuple[Any, Any]]


@dataclass(frozen=True)
class RingPlan:
    """The static shape of a ring: axis, its size, and the per-pair calls.

    ``full`` is a sub-chunk pair without causal mask, ``diag`` (zigzag only) a
    sub-chunk against itself under causal. Each device holds ``chunks`` (2 with
    zigzag, else 1) chunks of q and of kv, each cut in ``splits`` sub-chunks.
    """

    axis: str
    size: int
    zigzag: bool
    splits: int
    full: AttentionCall
    diag: AttentionCall | None = None

    @property
    def calls(self) -> tuple[AttentionCall, ...]:
        return tuple(c for c in (self.full, self.diag) if c is not None)

    @property
    def subs(self) -> int:
        """Sub-chunks of q (and of kv) each device holds."""
        return (2 if self.zigzag else 1) * self.splits

    def tables(self, own: bool) -> list[tuple[str, np.ndarray]]:
        """(kind, int32 [n, 2] (q sub, kv sub) pairs) to visit; ``other`` tables stack
        the lower-origin and higher-origin tables on a leading axis of 2."""
        n, m = self.splits, self.subs
        if not self.zigzag:
            return [("full", np.array([(a, b) for a in range(m) for b in range(m)], np.int32))]
        if own:
            below = [(a, b) for a in range(m) for b in range(a)]
            return [("diag", np.array([(a, a) for a in range(m)], np.int32)),
                    ("full", np.array(below, np.int32).reshape(-1, 2))]
        lower = [(a, b) for a in range(m) for b in range(n)]
        upper = [(a, b) for a in range(n, m) for b in range(m)]
        return [("full", np.array([lower, upper], np.int32))]


def _rows(x: Any) -> Any:
    """``[B, H, T]`` -> ``[B, T, H, 1]`` to scale rows of an output."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def merge(o: Any, lse: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Combine two normalised partial results (float32 out) by their lse."""
    new = jnp.logaddexp(lse, lse_b)
    dead = jnp.isneginf(new)
    w_a = jnp.where(dead, 0.0, jnp.exp(lse - new))
    w_b = jnp.where(dead, 0.0, jnp.exp(lse_b - new))
    return o * _rows(w_a) + o_b.astype(jnp.float32) * _rows(w_b), new


def _cut(x: Any, index: Any, size: int, axis: int) -> Any:
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _paste(x: Any, part: Any, index: Any, size: int, axis: int) -> Any:
    return jax.lax.dynamic_update_slice_in_dim(x, part, index * size, axis)


def _rotate(tree: Any, plan: RingPlan) -> Any:
    """Pass every ``[B, T_local, ...]`` leaf one device on along the ring."""
    perm = [(i, (i + 1) % plan.size) for i in range(plan.size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, plan.axis, perm), tree)


def _rotate_in_place(tree: Any, plan: RingPlan) -> Any:
    """:func:`_rotate` one kv sub-chunk at a time, each written back in place.

    Only one sub-chunk is in flight, not a rotated copy of the whole block
    next to the loop state it is copied into. (The backward keeps
    :func:`_rotate`: there the in-place form measured no smaller.)
    """
    perm = [(i, (i + 1) % plan.size) for i in range(plan.size)]
    lk = plan.full.kv_len

    def one(i: Any, x: Any) -> Any:
        return _paste(x, jax.lax.ppermute(_cut(x, i, lk, 1), plan.axis, perm), i, lk, 1)

    return jax.tree.map(lambda x: jax.lax.fori_loop(0, plan.subs, one, x), tree)


def _global_sub(plan: RingPlan, device: Any, b: Any) -> Any:
    """Global sub-chunk index of local kv sub-chunk ``b`` of ``device``."""
    n = plan.splits
    if not plan.zigzag:
        return device * n + b
    chunk = jnp.where(b < n, device, 2 * plan.size - 1 - device)
    return chunk * n + b % n


def _visit(plan: RingPlan, src: Any, own: bool, fn: Any, carry: Any) -> Any:
    """``carry = fn(call, a, b, carry)`` over the visible sub-chunk pairs of one block."""
    r = jax.lax.axis_index(plan.axis)
    for kind, table in plan.tables(own):
        call = plan.diag if kind == "diag" else plan.full
        pairs = jnp.asarray(table)
        if pairs.ndim == 3:
            pairs = pairs[jnp.where(src < r, 0, 1)]
        if pairs.shape[0] == 0:
            continue

        def body(i: Any, carry: Any, pairs: Any = pairs, call: Any = call) -> Any:
            return fn(call, pairs[i, 0], pairs[i, 1], carry)

        carry = jax.lax.fori_loop(0, pairs.shape[0], body, carry)
    return carry


def _pair_args(plan: RingPlan, q: Any, kv: Any, ext: dict[str, Any], src: Any,
               a: Any, b: Any) -> tuple[Any, Any, Any, Operands]:
    """Sub-chunk ``a`` of q and ``b`` of the kv block from ``src``, with their operands."""
    lq, lk = plan.full.q_len, plan.full.kv_len
    k, v, kv_ids = kv
    q_ids = ext.get("q_segment_ids")
    lengths = ext.get("kv_lengths")
    if lengths is not None:
        lengths = jnp.clip(lengths - _global_sub(plan, src, b) * lk, 0, lk)
    ops = Operands(
        None if q_ids is None else _cut(q_ids, a, lq, 1),
        None if kv_ids is None else _cut(kv_ids, b, lk, 1),
        None,
        lengths,
    )
    return _cut(q, a, lq, 1), _cut(k, b, lk, 1), _cut(v, b, lk, 1), ops


def _forward(plan: RingPlan, attend: Attend, q: Any, k: Any, v: Any,
             ext: dict[str, Any]) -> tuple[Any, Any]:
    bsz, t, h, _ = q.shape
    r = jax.lax.axis_index(plan.axis)
    lq = plan.full.q_len

    def step(src: Any, own: bool, acc: Any, kv: Any) -> Any:
        def pair(call: AttentionCall, a: Any, b: Any, acc: Any) -> Any:
            o, lse = acc
            o_b, lse_b = attend(call, *_pair_args(plan, q, kv, ext, src, a, b))
            part = merge(_cut(o, a, lq, 1), _cut(lse, a, lq, 2), o_b, lse_b)
            return _paste(o, part[0], a, lq, 1), _paste(lse, part[1], a, lq, 2)

        return _visit(plan, src, own, pair, acc)

    acc = (jnp.zeros((bsz, t, h, plan.full.v_head_dim), jnp.float32),
           jnp.full((bsz, h, t), -jnp.inf, jnp.float32))
    kv = (k, v, ext.get("kv_segment_ids"))
    acc = step(r, True, acc, kv)

    def later(s: Any, carry: Any) -> Any:
        acc, kv = carry
        kv = _rotate_in_place(kv, plan)
        return step((r - s) % plan.size, False, acc, kv), kv

    (o, lse), _ = jax.lax.fori_loop(1, plan.size, later, (acc, kv))
    return o.astype(q.dtype), lse


def _backward(plan: RingPlan, attend: Attend, res: Any, cts: Any) -> Any:
    q, k, v, ext, out, lse = res
    d_out, d_lse = cts
    d_out = d_out.astype(jnp.float32)
    d_lse = d_lse.astype(jnp.float32)
    delta = jnp.swapaxes(jnp.sum(d_out * out.astype(jnp.float32), axis=-1), 1, 2)
    r = jax.lax.axis_index(plan.axis)
    lq, lk = plan.full.q_len, plan.full.kv_len

    def step(src: Any, own: bool, grads: Any, kv: Any) -> Any:
        def pair(call: AttentionCall, a: Any, b: Any, grads: Any) -> Any:
            dq, dk, dv = grads
            qp, kp, vp, ops = _pair_args(plan, q, kv, ext, src, a, b)
            rows_lse, rows_dlse, rows_delta = (_cut(x, a, lq, 2) for x in (lse, d_lse, delta))
            rows_dout = _cut(d_out, a, lq, 1)
            (o_b, lse_b), pull = jax.vjp(lambda x, y, z: attend(call, x, y, z, ops), qp, kp, vp)
            w = jnp.where(jnp.isneginf(rows_lse), 0.0, jnp.exp(lse_b - rows_lse))
            inner = jnp.swapaxes(jnp.sum(rows_dout * o_b.astype(jnp.float32), axis=-1), 1, 2)
            gq, gk, gv = pull(((rows_dout * _rows(w)).astype(o_b.dtype),
                               w * (rows_dlse + inner - rows_delta)))
            dq = _paste(dq, _cut(dq, a, lq, 1) + gq.astype(jnp.float32), a, lq, 1)
            dk = _paste(dk, _cut(dk, b, lk, 1) + gk.astype(jnp.float32), b, lk, 1)
            dv = _paste(dv, _cut(dv, b, lk, 1) + gv.astype(jnp.float32), b, lk, 1)
            return dq, dk, dv

        return _visit(plan, src, own, pair, grads)

    kv = (k, v, ext.get("kv_segment_ids"))
    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    dq, dk, dv = step(r, True, zeros, kv)

    def later(s: Any, carry: Any) -> Any:
        dq, kv, dkv = carry
        # dk, dv travel with their block: both move one device on.
        kv, dkv = _rotate((kv, dkv), plan)
        dq, dk, dv = step((r - s) % plan.size, False, (dq, *dkv), kv)
        return dq, kv, (dk, dv)

    dq, _, dkv = jax.lax.fori_loop(1, plan.size, later, (dq, kv, (dk, dv)))
    if plan.size > 1:
        # The block of the last step started on device r + 1: one more hop home.
        dkv = _rotate(dkv, plan)
    dk, dv = dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def ring_fn(plan: RingPlan, attend: Attend) -> Callable[..., tuple[Any, Any]]:
    """``f(q, k, v, ext) -> (out, lse)`` on one device's shard, differentiable in q, k, v.

    q ``[B, Tq_local, Hq, D]``, k ``[B, Tk_local, Hkv, D]``, v ``[B, Tk_local,
    Hkv, Dv]`` (zigzag order when ``plan.zigzag``); ``ext`` holds the integer
    operands present: ``q_segment_ids`` / ``kv_segment_ids`` ``[B, T_local]``
    and global ``kv_lengths`` ``[B]``. out in q's dtype, lse ``[B, Hq,
    Tq_local]`` float32.
    """

    @jax.custom_vjp
    def ring(q: Any, k: Any, v: Any, ext: dict[str, Any]) -> tuple[Any, Any]:
        return _forward(plan, attend, q, k, v, ext)

    def ring_fwd(q: Any, k: Any, v: Any, ext: dict[str, Any]) -> Any:
        out, lse = _forward(plan, attend, q, k, v, ext)
        return (out, lse), (q, k, v, ext, out, lse)

    def ring_bwd(res: Any, cts: Any) -> Any:
        return _backward(plan, attend, res, cts)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring
