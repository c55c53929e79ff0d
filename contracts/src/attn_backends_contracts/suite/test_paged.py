"""Paged attention (the ``paged`` family), for a backend whose manifest declares
paged support (``attn_backends.PagedBackend``); skipped as not applicable otherwise.

Every call goes through the registry (``get_paged(backend=NAME,
fallback="error")``, no probe), as a serving engine's does. Each ``attend``
case runs its ragged batch twice under one ``jit``: with NaN, Inf and -Inf
everywhere the contract says never matters, and zero-filled; the two must be
bitwise equal, padding rows exactly zero, and the output within the tolerance
table of the float64 oracle (:func:`attn_backends.oracle.paged_attention`) on
the canonical view. ``store`` cases check ``write`` (every token at its slot,
every other slot bitwise unchanged, padding tokens never written) and the
layout's round trip through the canonical view, exact, in each claimed dtype.
Whatever the manifest does not claim, and any gradient, must be refused.

The ``quantized`` family is these tests on a cache stored quantized, in each
cache dtype the manifest claims (``PagedCapabilities.kv_dtypes``): the
oracle reads the dequantized cache exactly, so the output is judged at the
query dtype's tolerance; garbage fills unused values and scale slots; the
quantizer ``write`` applies is checked on its own (:mod:`._quantized`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.authoring import jax_api
from attn_backends.oracle import paged_attention

from attn_backends_contracts._inputs import x64_for
from attn_backends_contracts._session import family
from attn_backends_contracts.paged_cases import PagedSuiteCase, paged_case, unclaimed_case
from attn_backends_contracts.suite._quantized import check_quantized_write
from attn_backends_contracts.tolerances import compare, normalised_error, tolerance


def _applies(param: Any) -> PagedSuiteCase | tuple[str, str]:
    """The case, or a skip with the reason the family does not apply."""
    if isinstance(param, str):
        pytest.skip(param)
    return param


def _paged(suite: Any, case: PagedSuiteCase, *, declined_skips: bool = True) -> Any:
    """The registry's PagedAttention for ``case``'s call on the suite's platform.

    A call the manifest's fields allow but the backend declines on this platform,
    by its manifest's own ``unmet`` (a kernel that runs on a platform only for
    some calls, e.g. an emulated one: such a case was replaced at collection by
    its decode step where the manifest serves that, ``paged_cases.as_served``)
    or by ``check_paged``, is skipped with its reasons (shown in the summary and
    certificate).
    """
    if declined_skips:
        call = suite.registry.explain_paged(device=suite.platform, backend=suite.backend.name,
                                            **case.call_args()).call
        unmet = suite.backend.paged_capabilities.unmet(call, suite.platform)
        if unmet:
            pytest.skip(f"not served on {suite.platform} by the manifest: {'; '.join(unmet)}")
        reasons = [str(r) for r in suite.backend.check_paged(call)]
        if reasons:
            pytest.skip(f"declined by the backend's check_paged(): {'; '.join(reasons)}")
    return suite.registry.get_paged(device=suite.platform, backend=suite.backend.name,
                                    fallback="error", **case.call_args())


def _batch_case(case: PagedSuiteCase, *, garbage: bool) -> Any:
    return paged_case(case.seqs, page_size=case.page_size, hq=case.q_heads, hkv=case.kv_heads,
                      d=case.head_dim, num_seqs=case.num_seqs, order=case.order,
                      pad_rows=case.pad_rows, extra_cols=case.extra_cols,
                      spare_pages=case.spare_pages, garbage=garbage,
                      kv_dtype=case.kv_dtype)


def _canonical(batch: Any, dtype: str) -> list[Any]:
    """The batch's canonical arrays as jax arrays: K and V rounded to ``dtype``, or a
    quantized case's values and scales as they are."""
    if batch.k_scales is not None:
        return [jnp.asarray(x) for x in batch.canonical()]
    return [jnp.asarray(_cast(x, dtype)) for x in batch.canonical()]


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` on the host (NumPy; ml_dtypes for bfloat16 and
    float16): an eager jnp cast would compile a program of its own per shape."""
    return np.asarray(x).astype(jnp.dtype(dtype))


def _run(paged: Any, dirty: Any, clean: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The backend's output on the garbage batch and on its zero-filled twin (one jit)."""

    def step(q: Any, batch: Any, *arrays: Any) -> Any:
        return paged(q, paged.from_canonical(*arrays), batch)

    fn = jax.jit(step)
    outs = []
    for case in (dirty, clean):
        outs.append(np.asarray(fn(jnp.asarray(_cast(case.q, dtype)), case.batch(),
                                  *_canonical(case, dtype))))
    return outs[0], outs[1]


def _expected(paged: Any, clean: Any, dtype: str) -> np.ndarray:
    """The oracle on the clean batch as the backend sees it (rounded to ``dtype``; a
    quantized cache dequantized exactly)."""
    k, v = clean.dequantized() if clean.k_scales is not None else (
        _f64(_cast(x, dtype)) for x in (clean.k_pages, clean.v_pages))
    call = paged.call
    return paged_attention(_f64(_cast(clean.q, dtype)), k, v, clean.cu_q_lens, clean.kv_lens,
                           clean.page_table, clean.num_seqs, scale=call.scale,
                           softcap=call.softcap, window=call.window)


@family("paged")
def test_paged_matches_oracle(attn_suite: Any, attn_paged: Any) -> None:
    """Garbage changes nothing (bitwise), padding rows are zeros, and the output equals
    the float64 oracle's; a ``same_seq`` case also gives one sequence's rows twice alike."""
    suite, case = attn_suite, _applies(attn_paged)
    with x64_for(case.dtype):
        paged = _paged(suite, case)
        dirty, clean = _batch_case(case, garbage=True), _batch_case(case, garbage=False)
        if case.kind == "same_seq":
            for c in (dirty, clean):
                c.q[3:5] = c.q[0:2]
        out_dirty, out = _run(paged, dirty, clean, case.dtype)
        want = _expected(paged, clean, case.dtype)
    got = _f64(out)
    tol = tolerance(case.dtype, "out", platform=suite.platform)
    suite.note_errors(case.dtype, {"out": normalised_error(got, want, tol)})
    wrong = compare("out", got, want, tol)
    assert wrong is None, f"{case.id}: {wrong}"
    changed = ~((out_dirty == out) | (np.isnan(_f64(out_dirty)) & np.isnan(got)))
    assert not changed.any(), (
        f"{case.id}: NaN/Inf where the contract says nothing matters (unused pages, past "
        f"kv_lens, padding rows, uncounted sequences) changed {int(changed.sum())} output "
        f"values, the first at {tuple(int(i) for i in np.argwhere(changed)[0])}: got "
        f"{_f64(out_dirty)[changed][0]:.6g} instead of the zero-filled run's "
        f"{got[changed][0]:.6g}")
    counted = int(clean.cu_q_lens[clean.num_seqs])
    assert not got[counted:].any(), (
        f"{case.id}: padding rows {counted}..{got.shape[0] - 1} must output exactly 0, got "
        f"max |out| {np.max(np.abs(got[counted:])):.3g}")
    if case.kind == "same_seq":
        assert np.array_equal(out[0:2], out[3:5]), (
            f"{case.id}: the same sequence at table rows 0 and 2 (query rows 0-1 and 3-4) "
            "gave different outputs")


def _store_setup(suite: Any, case: PagedSuiteCase) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """The attention, the batch, and a pool of distinct random K and V in ``dtype``."""
    paged = _paged(suite, case)
    batch = _batch_case(case, garbage=False)
    rng = np.random.default_rng(7)
    k0, v0 = (_f64(_cast(rng.normal(size=batch.k_pages.shape), case.dtype)) for _ in range(2))
    return paged, batch, k0, v0


@family("paged")
def test_paged_write(attn_suite: Any, attn_paged_dtype: Any) -> None:
    """``write`` (jitted, the cache donated) puts every token at its slot, leaves every
    other slot bitwise unchanged and never writes a padding (negative-slot) token."""
    suite, case = attn_suite, _applies(attn_paged_dtype)
    if case.kv_dtype is not None:
        check_quantized_write(_paged(suite, case), _batch_case(case, garbage=True), case.id)
        return
    with x64_for(case.dtype):
        paged, batch, k0, v0 = _store_setup(suite, case)
        hkv, d = case.kv_heads, case.head_dim
        pad = np.array([-1, -2, -(2**30)], np.int32)
        slots = np.concatenate([batch.slots, pad])
        # Padding tokens carry NaN and Inf: written anywhere, they show.
        k = np.concatenate([batch.k_rows, np.full((3, hkv, d), np.nan, np.float32)])
        v = np.concatenate([batch.v_rows, np.full((3, hkv, d), np.inf, np.float32)])
        cache = paged.from_canonical(jnp.asarray(_cast(k0, case.dtype)),
                                     jnp.asarray(_cast(v0, case.dtype)))
        cache = jax.jit(paged.write, donate_argnums=0)(
            cache, jnp.asarray(_cast(k, case.dtype)), jnp.asarray(_cast(v, case.dtype)),
            jnp.asarray(slots))
        after = [_f64(x) for x in paged.to_canonical(cache)]
        wants = [_f64(_cast(rows, case.dtype)) for rows in (batch.k_rows, batch.v_rows)]
    flat = batch.k_pages.shape[0] * case.page_size
    for name, pool, old, want in (("K", after[0], k0, wants[0]), ("V", after[1], v0, wants[1])):
        pool, old = pool.reshape(flat, hkv, d), old.reshape(flat, hkv, d)
        misplaced = [int(t) for t in np.flatnonzero(
            ~np.all(pool[batch.slots] == want, axis=(1, 2)))]
        assert not misplaced, (
            f"{case.id}: {name} of tokens {misplaced[:5]} is not at their slots "
            f"{batch.slots[misplaced[:5]].tolist()} after write")
        rest = np.setdiff1d(np.arange(flat), batch.slots)
        touched = rest[~np.all(pool[rest] == old[rest], axis=(1, 2))]
        assert not touched.size, (
            f"{case.id}: write changed {name} at slots {touched[:5].tolist()}, which no "
            "token names (a padding token, slot < 0, written?)")


@family("paged")
def test_paged_in_shard_map(attn_suite: Any, attn_paged_dtype: Any) -> None:
    """Inside a user's ``jax.shard_map`` with ``check_vma=True`` (one device, so q and
    the cache vary over its manual axis): claimed (``PagedCapabilities.check_vma``),
    the output equals the oracle; unclaimed, a clean UnsupportedError naming the fix."""
    from attn_backends import UnsupportedError
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    suite, case = attn_suite, _applies(attn_paged_dtype)
    with x64_for(case.dtype):
        paged = _paged(suite, case)
        clean = _batch_case(case, garbage=False)
        device = jax.local_devices(backend=suite.platform)[0]
        mesh = Mesh(np.array([device]), ("user",), axis_types=(jax.sharding.AxisType.Auto,))

        def step(q: Any, batch: Any, *arrays: Any) -> Any:
            return paged(q, paged.from_canonical(*arrays), batch)

        arrays = _canonical(clean, case.dtype)
        # The kv heads of K and V [pages, ps, Hkv, D] (and scales [pages, ps, Hkv]).
        heads = [P(None, None, "user", *[None] * (x.ndim - 3)) for x in arrays]
        mapped = jax.jit(jax_api.shard_map(step, mesh=mesh,
                                           in_specs=(P(None, "user"), P(), *heads),
                                           out_specs=P(None, "user"), check_vma=True))
        args = [jnp.asarray(_cast(clean.q, case.dtype)), clean.batch(), *arrays]
        if not suite.backend.paged_capabilities.check_vma:
            with pytest.raises(UnsupportedError, match="check_vma=False"):
                mapped(*args)
            return
        got = _f64(mapped(*args))
        want = _expected(paged, clean, case.dtype)
    wrong = compare("out", got, want, tolerance(case.dtype, "out", platform=suite.platform))
    assert wrong is None, f"{case.id} in shard_map: {wrong}"


@family("paged")
def test_paged_round_trip(attn_suite: Any, attn_paged_dtype: Any) -> None:
    """The layout's round trip through the canonical view is exact both ways (the
    bits of NaN and Inf too), and the cache names the backend's layout."""
    suite, case = attn_suite, _applies(attn_paged_dtype)
    with x64_for(case.dtype):
        paged = _paged(suite, case)
        arrays = _canonical(_batch_case(case, garbage=True), case.dtype)
        cache = paged.from_canonical(*arrays)
        assert cache.layout == paged.layout, (
            f"{case.id}: from_canonical made a cache in layout {cache.layout!r}, the backend "
            f"names {paged.layout!r}")
        back = paged.to_canonical(cache)
        again = paged.from_canonical(*back)
    assert len(back) == len(arrays), (
        f"{case.id}: to_canonical gave {len(back)} arrays, expected {len(arrays)}")
    for name, a, b in zip(("K", "V", "K's scales", "V's scales"), back, arrays, strict=False):
        assert np.asarray(a).dtype == np.asarray(b).dtype and \
            np.asarray(a).tobytes() == np.asarray(b).tobytes(), (
                f"{case.id}: {name} after from_canonical then to_canonical differs from "
                "what went in")
    for i, (a, b) in enumerate(zip(again.arrays, cache.arrays, strict=True)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (
            f"{case.id}: cache array {i} after to_canonical then from_canonical differs")


@family("paged_unclaimed")
def test_paged_unclaimed_raises(attn_suite: Any, attn_paged_unclaimed: Any) -> None:
    """What the paged manifest does not claim raises UnsupportedError at ``get_paged``;
    a gradient through a paged call raises it when traced."""
    import attn_backends

    suite = attn_suite
    kind, value = _applies(attn_paged_unclaimed)
    case = unclaimed_case(suite.backend, kind, value)
    if kind != "gradient":
        with x64_for(case.dtype), pytest.raises(attn_backends.UnsupportedError):
            _paged(suite, case, declined_skips=False)
        return
    paged = _paged(suite, case)
    batch = _batch_case(case, garbage=False)
    k, v = (jnp.asarray(x, case.dtype) for x in (batch.k_pages, batch.v_pages))

    def loss(q: Any) -> Any:
        out = paged(q, paged.from_canonical(k, v), batch.batch())
        return jnp.sum(out.astype(jnp.float32))

    with pytest.raises(attn_backends.UnsupportedError):
        jax.eval_shape(jax.grad(loss), jnp.asarray(batch.q, case.dtype))
