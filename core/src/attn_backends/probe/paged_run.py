"""One paged probe run: the backend's ``write`` and ``attend_paged`` on a small ragged
batch, against the float64 oracle (docs/DESIGN.md, "Probes, verdicts and
certificates").

The batch (:func:`probe_batch`) holds every kind of sequence around the call's
page size: a decode step whose key sits alone in a partial last page, a pure
prefill crossing a page boundary, a sequence with no new tokens, a chunked
prefill ending in a partial page, and an uncounted table row; pages in random
order, padding query rows, and NaN, Inf and -Inf in every place the contract
says never matters. The cache is made with ``from_canonical`` without the
rows' own keys, which ``write`` then puts in (with padding tokens of NaN and
Inf at negative slots), as a serving step does: write, then attend. The write
must leave the canonical view bit for bit as expected; the output must agree
with the oracle under :func:`attn_backends.tolerances.compare`, the
comparison of the suite and the dense probe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..contract.call import WIDE_DTYPES
from ..contract.environment import local_device
from ..contract.paged import PagedBackend, PagedCall
from ..contract.paged_quantize import LARGEST
from .paged_inputs import PagedCase, dequantize_rows, half_step, paged_case
from .tolerances import compare, tolerance

#: Padding tokens given to ``write``, at these (negative) slots.
PAD_SLOTS = (-1, -2)


def probe_batch(call: PagedCall) -> PagedCase:
    """The probe's ragged batch for ``call`` (rows per sequence cut to ``max_q_len``)."""
    p = call.page_size
    seqs = [(1, 2 * p + 1), (p + 1, p + 1), (0, 3), (3, 3 * p - 1), (2, 5)]
    if call.max_q_len is not None:
        seqs = [(min(q, call.max_q_len), kv) for q, kv in seqs]
    return paged_case(seqs, page_size=p, hq=call.q_heads, hkv=call.kv_heads, d=call.head_dim,
                      num_seqs=4, pad_rows=2, order="random", seed=0,
                      kv_dtype=call.kv_dtype)


def _written(call: PagedCall, case: PagedCase) -> tuple[list[np.ndarray], np.ndarray,
                                                        np.ndarray, np.ndarray]:
    """The canonical arrays without the rows' own keys (garbage there instead), and the
    tokens ``write`` must put in (float K and V, and their slots): those keys at
    their slots, then padding tokens of NaN and Inf."""
    new = case.new_token_slots()
    p = call.page_size
    index = {int(slot): i for i, slot in enumerate(case.slots)}
    rows = [index[int(slot)] for slot in new]
    arrays = [x.copy() for x in case.canonical()]
    for x, fill in zip(arrays, (np.nan, np.inf, np.nan, np.nan), strict=False):
        # int8 holds no NaN: its largest byte stands in for garbage.
        x[new // p, new % p] = 127 if x.dtype.kind == "i" else fill
    shape = (len(PAD_SLOTS), call.kv_heads, call.head_dim)
    slots = np.concatenate([new, np.asarray(PAD_SLOTS, np.int32)])
    k = np.concatenate([case.k_rows[rows], np.full(shape, np.nan, np.float32)])
    v = np.concatenate([case.v_rows[rows], np.full(shape, -np.inf, np.float32)])
    return arrays, k, v, slots


def _same(got: np.ndarray, want: np.ndarray, quantized: bool) -> np.ndarray:
    """Per slot (rows of ``[slots, ...]``): bitwise equal, or for a quantized cache
    equal as numbers with NaN equal to NaN (XLA may rewrite a float8 NaN's payload)."""
    if not quantized:
        return np.all(got.view(np.uint8) == want.view(np.uint8), axis=1)
    got, want = got.astype(np.float64), want.astype(np.float64)
    return np.all((got == want) | (np.isnan(got) & np.isnan(want)), axis=1)


def _write_reasons(call: PagedCall, case: PagedCase, pools: Any, tokens: tuple[Any, Any],
                   dtype: Any) -> list[str]:
    """What ``write`` got wrong: ``pools`` (its canonical view after the write) against
    the case's arrays, bit for bit; a quantized call's written tokens against the
    tokens given (``tokens``, float K and V in write's order), each element within
    half a step of its stored value times its scale."""
    new = case.new_token_slots()
    reasons = []
    want_pools = case.canonical() if call.quantized else [
        x.astype(dtype) for x in case.canonical()]
    names = ("K", "V", "K's scales", "V's scales")
    for name, got, want in zip(names, pools, want_pools, strict=False):
        got = np.asarray(got)
        flat = got.shape[0] * got.shape[1]
        same = _same(got.reshape(flat, -1), np.asarray(want).reshape(flat, -1), call.quantized)
        if call.quantized:
            same[new] = True  # judged by the quantizer's rule below
        wrong = np.flatnonzero(~same)
        if not call.quantized:
            at_new = wrong[np.isin(wrong, new)]
            if at_new.size:
                reasons.append(f"probe: write left {name} wrong: {at_new.size} written "
                               f"tokens are not at their slots, on {call.describe()}")
        other = wrong[~np.isin(wrong, new)]
        if other.size:
            reasons.append(f"probe: write changed {name} at {other.size} slots no token names, "
                           f"e.g. slot {int(other[0])} (a padding token, slot < 0, written?), "
                           f"on {call.describe()}")
    if call.quantized:
        for name, values, scales, x in zip(("K", "V"), pools[:2], pools[2:], tokens, strict=True):
            values = np.asarray(values).reshape(-1, call.kv_heads, call.head_dim)[new]
            scales = np.asarray(scales).reshape(-1, call.kv_heads)[new].astype(np.float64)
            x = np.asarray(x[: new.size]).astype(np.float64)
            err = np.abs(dequantize_rows(values, scales) - x)
            bound = half_step(values, call.kv_dtype) * scales[..., None] + 1e-6 * np.abs(x)
            # The rule's scale, max|x| / largest: a larger one keeps every element
            # within its (coarser) half step, and so does the oracle reading it.
            want = np.abs(x).max(-1) / LARGEST[call.kv_dtype]
            if not np.all(err <= bound):
                reasons.append(f"probe: write quantized {name} wrong: an element is "
                               f"{np.max(err - bound):.3g} past half a step of its stored value "
                               f"times its scale, on {call.describe()}")
            elif not np.allclose(scales, want, rtol=3e-7, atol=0):
                worst = np.max(np.abs(scales / want - 1))
                reasons.append(f"probe: write quantized {name} wrong: scales are not max|x| / "
                               f"{LARGEST[call.kv_dtype]:g} (worst {worst:.3g} "
                               f"off), on {call.describe()}")
    return reasons


def run_paged_probe(backend: Any, call: PagedCall, platform: str,
                    options: Any = None) -> list[str]:
    """Run ``backend``'s paged ``write`` and ``attend_paged`` for ``call`` on
    ``platform`` (one jitted step: write, then attend) and compare with the
    float64 oracle; the reasons it disagrees (empty: it agrees). ``options`` are
    the caller's options for the backend."""
    import jax
    import jax.numpy as jnp

    from .paged_oracle import paged_attention as oracle

    paged: PagedBackend = backend
    target = dataclasses.replace(call, platform=platform)
    case = probe_batch(call)
    arrays, k, v, slots = _written(call, case)

    def step(k: Any, v: Any, slots: Any, q: Any, batch: Any, *arrays: Any) -> Any:
        cache = paged.write(target, paged.from_canonical(target, *arrays), k, v, slots)
        out = paged.attend_paged(target, q, cache, batch, options)
        return paged.to_canonical(target, cache), out

    # The probe runs in a worker thread: a float64 call needs x64 there too.
    with (jax.enable_x64(call.dtype in WIDE_DTYPES),
          jax.default_device(local_device(platform))):
        dtype = jnp.dtype(call.dtype)
        if not call.quantized:
            arrays = [x.astype(dtype) for x in arrays]
        tokens = [jnp.asarray(x, dtype) for x in (k, v)]
        pools, out = jax.jit(step)(*tokens, jnp.asarray(slots), jnp.asarray(case.q, dtype),
                                   case.batch(), *(jnp.asarray(x) for x in arrays))
        got = np.asarray(out).astype(np.float64)
        rounded = [np.asarray(x).astype(np.float64) for x in (jnp.asarray(case.q, dtype),
                                                               *tokens)]
        # The attention of the case's cache, or of a quantized cache as written
        # (dequantized exactly: the write itself is judged on its own above).
        pages = (case.k_pages, case.v_pages)
        if not call.quantized:
            pages = tuple(np.asarray(jnp.asarray(x, dtype)).astype(np.float64) for x in pages)
    pools = [np.asarray(x) for x in pools]
    reasons = _write_reasons(call, case, pools, (rounded[1], rounded[2]), dtype)
    if call.quantized:
        pages = dataclasses.replace(case, k_pages=pools[0], v_pages=pools[1],
                                    k_scales=pools[2], v_scales=pools[3]).dequantized()
    want = oracle(rounded[0], *pages, case.cu_q_lens, case.kv_lens,
                  case.page_table, case.num_seqs, scale=call.scale, softcap=call.softcap,
                  window=call.window)
    wrong = compare("out", got, want, tolerance(call.dtype, "out", platform=platform))
    if wrong is not None:
        reasons.append(f"probe: {wrong}, on {call.describe()} (a ragged batch of decode, "
                       "prefill and chunked-prefill rows over pages in random order)")
    return reasons
