"""Helpers for paged-attention tests: ragged batches with garbage where the contract
says it never matters (:func:`paged_case`, :class:`PagedCase`, from the shipped
suite's :mod:`attn_backends_contracts.paged_cases`), the case set every paged
backend's tests run (:class:`PagedCases`), and fake paged backends (no plugin
imports)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import ALL_FEATURES
from attn_backends import Backend, Capabilities, KVCache, PagedBackend, PagedCapabilities
from attn_backends.authoring import CANONICAL_LAYOUT, canonical_write
from attn_backends.oracle import paged_attention as oracle
from attn_backends.probe.paged_inputs import BAD_INDEX
from attn_backends_contracts.paged_cases import PagedCase, paged_case

#: The switches that let the Pallas kernels serve cpu, emulated (slow; for tests).
INTERPRET = ("ATTN_BACKENDS_PALLAS_INTERPRET", "ATTN_BACKENDS_TRITON_INTERPRET")


@contextlib.contextmanager
def interpret_switches() -> Iterator[None]:
    """Both Pallas interpret switches on inside the block (the environment restored after)."""
    saved = {name: os.environ.get(name) for name in INTERPRET}
    os.environ.update(dict.fromkeys(INTERPRET, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def paged_servers(registry: ab.Registry, device: str, **call: Any) -> list[str]:
    """The backends that accept the paged ``call`` on ``device``, the Pallas ones
    judged in interpret mode (so on cpu they count when they serve it emulated)."""
    with interpret_switches():
        verdicts = registry.explain_paged(device=device, **call).verdicts
    return [v.backend for v in verdicts if v.accepted]

__all__ = ["BAD_INDEX", "PS", "PagedCase", "PagedCases", "make_paged_backend", "paged_case"]

#: Page size of :class:`PagedCases`: small, so a few tokens cross several pages.
PS = 4
#: ``test_lengths_around_a_page``'s key lengths, as (pages, extra) with
#: kv_len = pages * page_size + extra: 1, ps - 1, ps, ps + 1, 3 ps + 2, 9 ps + 3.
LENGTHS = [(0, 1), (1, -1), (1, 0), (1, 1), (3, 2), (9, 3)]
#: :meth:`PagedCases.paged`'s attentions, by class and call.
_ATTENTIONS: dict[tuple[Any, ...], Any] = {}



@functools.partial(jax.jit, static_argnums=0)
def _jitted_call(paged: Any, q: Any, cache: Any, batch: Any) -> Any:
    """``paged(q, cache, batch)`` under one jit per attention (keyed by identity), so
    a case and its zero-filled twin run one compiled program on different data."""
    return paged(q, cache, batch)


class PagedCases:
    """The paged case set against the float64 oracle, for one backend: subclass it
    as ``Test...`` with ``backend`` (and ``options``, its ``backend_options``).

    Every length class around a page, page orders, garbage, batch shapes, GQA,
    softcap, window, write and the round trip. The batch is traced (one jitted
    program per attention and shape, which the cases of one call at one shape
    share), so what is checked is the vectorised program a serving loop runs.

    A backend (or one of its kernels) serving only decode steps sets
    ``max_q_len`` (calls are made with it; each case's sequences get at most that
    many rows, and the length cases other than decode are not generated) and
    ``dtype``; one serving no window sets ``test_window = None`` (not collected)
    and shows elsewhere where windowed calls go.
    """

    backend: ClassVar[str]
    options: ClassVar[Any] = None
    # The shape every case runs at: a backend whose kernel takes only some page
    # sizes or head dims sets them (the lengths and windows below follow it).
    page_size: ClassVar[int] = PS
    head_dim: ClassVar[int] = 8
    #: The layout the backend's caches are in.
    layout: ClassVar[str] = CANONICAL_LAYOUT
    #: Whether it claims float64 (under x64); if not, float64 must be refused.
    float64: ClassVar[bool] = True
    # float32 with exact (HIGHEST) matmuls from float32 inputs: far inside what
    # the dense float32 row allows any backend.
    atol: ClassVar[float] = 2e-6
    rtol: ClassVar[float] = 0.0
    #: The calls' dtype; the cases' q, K and V are rounded to it, so the float64
    #: oracle sees what the backend sees.
    dtype: ClassVar[str] = "float32"
    #: The calls' ``max_q_len`` (None: any); see the class docstring.
    max_q_len: ClassVar[int | None] = None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """The length cases' kinds: only decode steps for a decode-only class."""
        if "kind" in metafunc.fixturenames:
            kinds = ["prefill", "chunk", "decode"] if self.max_q_len is None else ["decode"]
            metafunc.parametrize("kind", kinds)

    def seqs(self, seqs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(q_len, kv_len)`` pairs with at most ``max_q_len`` rows each."""
        top = self.max_q_len
        return [(q if top is None else min(q, top), kv) for q, kv in seqs]

    def case(self, seqs: Sequence[tuple[int, int]], **case_args: Any) -> PagedCase:
        """:func:`paged_case` of ``self.seqs(seqs)`` with q, K and V rounded to ``dtype``."""
        case = paged_case(self.seqs(seqs), **{"page_size": self.page_size, "d": self.head_dim,
                                              **case_args})
        for name in ("q", "k_pages", "v_pages", "k_rows", "v_rows"):
            x = getattr(case, name)
            setattr(case, name, np.array(jnp.asarray(x, self.dtype), np.float32))
        return case

    def paged(self, **call: Any) -> Any:
        """The class's backend for ``call`` (over the class's defaults): one
        PagedAttention per class, options and call, so the cases of one call and shape run
        one compiled program (``_jitted_call`` is keyed by the attention)."""
        args = {**dict(num_q_heads=4, num_kv_heads=2, head_dim=self.head_dim,
                       page_size=self.page_size, dtype=self.dtype, max_q_len=self.max_q_len),
                **call}
        key = (type(self), repr(self.options), tuple(sorted(args.items())),
               jax.config.jax_enable_x64)
        if key not in _ATTENTIONS:
            options = None if self.options is None else {self.backend: self.options}
            _ATTENTIONS[key] = ab.registry.get_paged(backend=self.backend,
                                                     backend_options=options, **args)
        return _ATTENTIONS[key]

    @staticmethod
    def run(paged: Any, case: PagedCase) -> np.ndarray:
        """The backend's output in float32 (float64 for a float64 call)."""
        dtype = paged.call.dtype
        cache = paged.from_canonical(jnp.asarray(case.k_pages, dtype),
                                     jnp.asarray(case.v_pages, dtype))
        out = _jitted_call(paged, jnp.asarray(case.q, dtype), cache, case.batch())
        return np.asarray(out, np.float64 if out.dtype == jnp.float64 else np.float32)

    def agrees(self, seqs: Sequence[tuple[int, int]], *, call: dict[str, Any] | None = None,
               **case_args: Any) -> np.ndarray:
        """The backend on a case with garbage equals its zero-filled twin bitwise and
        the oracle within ``atol``; padding rows are zeros."""
        call = call or {}
        hq, hkv = call.get("num_q_heads", 4), call.get("num_kv_heads", 2)
        paged = self.paged(**call)
        dirty = self.case(seqs, hq=hq, hkv=hkv, **case_args)
        clean = self.case(seqs, hq=hq, hkv=hkv, garbage=False, **case_args)
        out = self.run(paged, dirty)
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out, self.run(paged, clean))
        expected = clean.expected(scale=paged.call.scale, softcap=paged.call.softcap,
                                  window=paged.call.window)
        np.testing.assert_allclose(out, expected, atol=self.atol, rtol=self.rtol)
        assert not out[int(dirty.cu_q_lens[dirty.num_seqs]):].any()
        return out

    # kind (prefill, chunk, decode): pytest_generate_tests.
    @pytest.mark.parametrize("pages, extra", LENGTHS)
    def test_lengths_around_a_page(self, pages: int, extra: int, kind: str) -> None:
        # Every length and kind at one shape, that of the longest prefill plus a
        # padding row (the rest padding rows, spare pages and table columns, all
        # garbage), as a serving engine pads its batches: one compiled program.
        kv_len = pages * self.page_size + extra
        q_len = self.seqs([({"prefill": kv_len, "chunk": max(1, kv_len // 2),
                             "decode": 1}[kind], kv_len)])[0][0]
        longest = max(p * self.page_size + e for p, e in LENGTHS)
        rows = self.seqs([(longest, longest)])[0][0] + 1
        pages_needed = -(-kv_len // self.page_size)
        most_pages = -(-longest // self.page_size)
        self.agrees([(q_len, kv_len)], pad_rows=rows - q_len,
                    spare_pages=most_pages - pages_needed + 2,
                    extra_cols=most_pages - pages_needed + 1)

    @pytest.mark.parametrize("order", ["random", "reversed", "shared"])
    def test_page_orders(self, order: str) -> None:
        self.agrees([(3, 11), (1, 7), (2, 11)], order=order, spare_pages=3)

    def test_mixed_batch_in_any_order_with_uncounted_rows_and_empty_sequences(self) -> None:
        # prefill, decode, zero new tokens, chunk, decode; the last two table rows
        # are not counted (num_seqs=5) and hold garbage metadata.
        seqs = [(6, 6), (1, 9), (0, 5), (3, 10), (1, 1), (4, 4), (2, 8)]
        self.agrees(seqs, num_seqs=5, pad_rows=3, extra_cols=2)

    def test_no_counted_sequence_gives_zeros(self) -> None:
        self.agrees([(2, 3), (1, 4)], num_seqs=0, pad_rows=4)

    @pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
    def test_gqa_and_mqa(self, heads: tuple[int, int]) -> None:
        hq, hkv = heads
        self.agrees([(3, 7), (1, 10)], call=dict(num_q_heads=hq, num_kv_heads=hkv))

    # window = pages * page_size + extra: 0, 1, ps, 2 ps + 1.
    @pytest.mark.parametrize("pages, extra", [(0, 0), (0, 1), (1, 0), (2, 1)])
    def test_window(self, pages: int, extra: int) -> None:
        window = pages * self.page_size + extra
        self.agrees([(5, 13), (1, 12), (9, 9), (1, 30)], call=dict(window=(window, None)))

    def test_softcap_and_scale(self) -> None:
        self.agrees([(5, 13), (1, 6)], call=dict(softcap=2.0, scale=0.9))

    def test_the_same_sequence_at_two_positions_gives_the_same_answer(self) -> None:
        paged = self.paged()
        case = self.case([(2, 9), (1, 3), (2, 9)], order="shared")
        cu = case.cu_q_lens
        first, again = slice(cu[0], cu[1]), slice(cu[2], cu[3])
        case.q[again] = case.q[first]
        out = self.run(paged, case)
        np.testing.assert_array_equal(out[first], out[again])
        np.testing.assert_allclose(out, case.expected(), atol=self.atol, rtol=self.rtol)

    def test_write_then_attend_and_write_exactness(self) -> None:
        """Prefill by writing every token, then a decode step writing its own key
        first: each token lands where its slot says, padding slots write nothing."""
        paged = self.paged()
        d = self.head_dim
        case = self.case([(3, 6), (1, 9)], garbage=False)
        cache = paged.init_cache(case.k_pages.shape[0])
        pad = np.full(3, -1, np.int32)
        slots = np.concatenate([case.slots, pad])
        k = np.concatenate([case.k_rows, np.full((3, 2, d), np.nan, np.float32)])
        v = np.concatenate([case.v_rows, np.full((3, 2, d), np.inf, np.float32)])
        before = [np.asarray(x, np.float32) for x in paged.to_canonical(cache)]  # donated below
        cache = jax.jit(paged.write, donate_argnums=0)(
            cache, jnp.asarray(k, self.dtype), jnp.asarray(v, self.dtype), jnp.asarray(slots))
        after = paged.to_canonical(cache)
        for pool, want, old in zip(after, (case.k_pages, case.v_pages), before, strict=True):
            pool = np.asarray(pool, np.float32)
            np.testing.assert_array_equal(pool, want)  # written exactly, pad never
            flat, old = pool.reshape(-1, 2, d), old.reshape(-1, 2, d)
            rest = np.setdiff1d(np.arange(flat.shape[0]), case.slots)
            np.testing.assert_array_equal(flat[rest], old[rest])
        out = jax.jit(paged.__call__)(jnp.asarray(case.q, self.dtype), cache, case.batch())
        np.testing.assert_allclose(np.asarray(out, np.float32), case.expected(), atol=self.atol,
                                   rtol=self.rtol)

    def test_float64_under_x64_computes_in_float64(self) -> None:
        shape = dict(page_size=self.page_size, d=self.head_dim, pad_rows=1)
        case = paged_case(self.seqs([(3, 7), (1, 10)]), **shape)
        if not self.float64:
            refused = pytest.raises(ab.UnsupportedError, match="dtype float64 not in")
            with jax.enable_x64(True), refused:
                self.paged(dtype="float64")
            return
        with jax.enable_x64(True):
            paged = self.paged(dtype="float64")
            cache = paged.from_canonical(*(jnp.asarray(x, jnp.float64)
                                           for x in (case.k_pages, case.v_pages)))
            out = jax.jit(paged.__call__)(jnp.asarray(case.q, jnp.float64), cache, case.batch())
            assert out.dtype == jnp.float64
            out = np.asarray(out)
        clean = paged_case(self.seqs([(3, 7), (1, 10)]), **shape, garbage=False)
        np.testing.assert_allclose(out, clean.expected(), atol=1e-12, rtol=0)

    def test_layout_round_trip_is_exact(self) -> None:
        paged = self.paged(dtype="bfloat16")
        case = self.case([(2, 7)])
        k, v = (jnp.asarray(x, jnp.bfloat16) for x in (case.k_pages, case.v_pages))
        cache = paged.from_canonical(k, v)
        assert cache.layout == paged.layout == self.layout
        back = paged.to_canonical(cache)
        for a, b in zip(back, (k, v), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- TPU exports: what a paged step's StableHLO does with the cache -------------

#: A pool size no other array of the exports has.
POOL = 37
TPU = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
    device_kind="TPU v5 lite", num_cores=1, platform="tpu"))


def cache_sized_ops(module: str, shape: tuple[int, ...], dtype: str) -> list[str]:
    """Every op of the StableHLO ``module`` with an operand or result of ``shape``
    and ``dtype`` other than the kernel's ``tpu_custom_call``, function calls,
    signatures and returns (which move nothing)."""
    ty = "tensor<" + "x".join(map(str, shape)) + f"x{dtype}>"
    # Also allowed: the end of the one-branch ``stablehlo.case`` on the platform
    # index that core's lax.platform_dependent wraps a paged call in (its result is
    # the branch's; XLA folds the case away).
    allowed = re.compile(r"^\s*(func\.func|func\.return|return|stablehlo\.return|"
                         r"(%\S+ = )?(func\.)?call @|"
                         r"(%\S+ = )?stablehlo\.custom_call @tpu_custom_call|"
                         r"\}\) : \(tensor<i32>\) ->)")
    return [line.strip()[:160] for line in module.splitlines()
            if ty in line and not allowed.match(line)]


def _oracle_attend(call: ab.PagedCall, q: Any, k_pages: Any, v_pages: Any,
                   batch: ab.PagedBatch) -> Any:
    """The float64 oracle run as a host callback: a fake that computes, with no
    code of its own to trust."""

    def host(q: Any, k: Any, v: Any, cu: Any, kv: Any, table: Any, num: Any) -> np.ndarray:
        return oracle(q, k, v, cu, kv, table, num, scale=call.scale, softcap=call.softcap,
                      window=call.window).astype(q.dtype)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), q, k_pages,
                             v_pages, *batch)


def make_paged_backend(name: str, *, priority: int = 10, layout: str = CANONICAL_LAYOUT,
                       platforms: tuple[str, ...] = ("cpu", "gpu", "tpu"),
                       check_paged: Callable[[ab.PagedCall], list[str]] | None = None,
                       **paged: Any) -> Backend:
    """A dense fake that also serves paged calls, through the oracle. ``layout``
    ``"heads_first"`` keeps K and V ``[Hkv, num_pages, page_size, D]``, so the
    canonical view is a real conversion."""
    claims = {"gqa": True, "softcap": True, "window": True, **paged}

    class FakePaged(Backend, PagedBackend):
        version = "9.9"
        capabilities = Capabilities(platforms=frozenset(platforms), **ALL_FEATURES)
        paged_capabilities = PagedCapabilities(platforms=frozenset(platforms), **claims)

        def attend(self, call, q, k, v, operands, options=None):  # type: ignore[no-untyped-def]
            raise AssertionError("the paged fakes serve paged calls only")

        def check_paged(self, call: ab.PagedCall) -> list[str]:
            return check_paged(call) if check_paged else []

        def cache_layout(self, call: ab.PagedCall) -> str:
            return layout

        def from_canonical(self, call: ab.PagedCall, k_pages: Any, v_pages: Any) -> KVCache:
            if layout == CANONICAL_LAYOUT:
                return super().from_canonical(call, k_pages, v_pages)
            arrays = tuple(jnp.transpose(x, (2, 0, 1, 3)) for x in (k_pages, v_pages))
            return KVCache(arrays, layout, call.page_size, k_pages.shape[0])

        def to_canonical(self, call: ab.PagedCall, cache: KVCache) -> tuple[Any, Any]:
            if layout == CANONICAL_LAYOUT:
                return super().to_canonical(call, cache)
            k, v = (jnp.transpose(x, (1, 2, 0, 3)) for x in cache.arrays)
            return k, v

        def write(self, call: ab.PagedCall, cache: KVCache, k: Any, v: Any,
                  slots: Any) -> KVCache:
            if layout == CANONICAL_LAYOUT:
                return super().write(call, cache, k, v, slots)
            pages = canonical_write(call, *self.to_canonical(call, cache), k, v, slots)
            return self.from_canonical(call, *pages)

        def attend_paged(self, call, q, cache, batch, options=None):  # type: ignore[no-untyped-def]
            k, v = self.to_canonical(call, cache)
            return _oracle_attend(call, q, k, v, batch)

    FakePaged.name = name
    FakePaged.priority = {p: priority for p in ("cpu", "gpu", "tpu")}
    return FakePaged()
