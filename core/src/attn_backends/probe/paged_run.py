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
from .paged_inputs import PagedCase, paged_case
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
                      num_seqs=4, pad_rows=2, order="random", seed=0)


def _bits(x: Any) -> bytes:
    return np.asarray(x).tobytes()


def _written(call: PagedCall, case: PagedCase) -> tuple[np.ndarray, ...]:
    """The pools without the rows' own keys (garbage there instead), and the tokens
    ``write`` must put in: those keys at their slots, then padding tokens."""
    new = case.new_token_slots()
    p = call.page_size
    k_pages, v_pages = case.k_pages.copy(), case.v_pages.copy()
    k_new, v_new = k_pages[new // p, new % p], v_pages[new // p, new % p]
    k_pages[new // p, new % p] = np.nan
    v_pages[new // p, new % p] = np.inf
    shape = (len(PAD_SLOTS), call.kv_heads, call.head_dim)
    slots = np.concatenate([new, np.asarray(PAD_SLOTS, np.int32)])
    k = np.concatenate([k_new, np.full(shape, np.nan, np.float32)])
    v = np.concatenate([v_new, np.full(shape, -np.inf, np.float32)])
    return k_pages, v_pages, k, v, slots


def _write_reasons(call: PagedCall, case: PagedCase, pools: Any, dtype: Any) -> list[str]:
    """What ``write`` got wrong: ``pools`` (its canonical view after the write) against
    the case's pools, bit for bit."""
    new = case.new_token_slots()
    reasons = []
    for name, got, want in zip(("K", "V"), pools, (case.k_pages, case.v_pages), strict=True):
        got, want = np.asarray(got), np.asarray(want.astype(dtype))
        flat_got = got.reshape(-1, *got.shape[2:]).view(np.uint8)
        flat_want = want.reshape(-1, *want.shape[2:]).view(np.uint8)
        wrong = np.flatnonzero(~np.all(flat_got == flat_want, axis=(1, 2)))
        if not wrong.size:
            continue
        at_new = np.isin(wrong, new)
        other = wrong[~at_new]
        said = [f"{int(at_new.sum())} written tokens are not at their slots" if at_new.any()
                else "", f"{other.size} slots no token names changed, e.g. slot "
                f"{int(other[0])} (a padding token, slot < 0, written?)" if other.size else ""]
        reasons.append(f"probe: write left {name} wrong: " + "; ".join(x for x in said if x)
                       + f", on {call.describe()}")
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
    k_pages, v_pages, k, v, slots = _written(call, case)

    def step(k_pages: Any, v_pages: Any, k: Any, v: Any, slots: Any, q: Any,
             batch: Any) -> Any:
        cache = paged.write(target, paged.from_canonical(target, k_pages, v_pages), k, v, slots)
        out = paged.attend_paged(target, q, cache, batch, options)
        return paged.to_canonical(target, cache), out

    # The probe runs in a worker thread: a float64 call needs x64 there too.
    with (jax.enable_x64(call.dtype in WIDE_DTYPES),
          jax.default_device(local_device(platform))):
        dtype = jnp.dtype(call.dtype)
        arrays = [jnp.asarray(x, dtype) for x in (k_pages, v_pages, k, v)]
        pools, out = jax.jit(step)(*arrays, jnp.asarray(slots), jnp.asarray(case.q, dtype),
                                   case.batch())
        got = np.asarray(out).astype(np.float64)
        rounded = [np.asarray(jnp.asarray(x, dtype)).astype(np.float64)
                   for x in (case.q, case.k_pages, case.v_pages)]
    reasons = _write_reasons(call, case, pools, dtype)
    want = oracle(*rounded, case.cu_q_lens, case.kv_lens, case.page_table, case.num_seqs,
                  scale=call.scale, softcap=call.softcap, window=call.window)
    wrong = compare("out", got, want, tolerance(call.dtype, "out", platform=platform))
    if wrong is not None:
        reasons.append(f"probe: {wrong}, on {call.describe()} (a ragged batch of decode, "
                       "prefill and chunked-prefill rows over pages in random order)")
    return reasons
