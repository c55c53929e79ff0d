"""Continuous batching of Gemma 3 over the registry's paged KV-cache contract.

One pool of pages per layer, shared by every request: a request takes pages
from a free list as it grows and returns them when it ends (EOS or its
``max_new`` tokens). Each step packs one decode row per request past its prompt
and prefill chunks (``chunk_budget`` rows in all at most) into ONE ragged batch
(``PagedBatch``), writes every row's K and V into its layer's cache and attends
there: the local layers through a ``PagedAttention`` with the window in its
call (``window=(511, None)``), the global ones through one without. Greedy
decoding; a step's program is compiled ahead of its first run per row bucket
(powers of two), so step times never include compilation.

``kv_dtype`` stores every layer's cache quantized (int8 or float8: values
and a float32 scale per position and kv head, the registry's rule): the bytes
a token keeps (:meth:`Engine.bytes_per_token`) and the requests a memory budget
holds (:meth:`Engine.requests_in`) follow. :meth:`Engine.log_probs` scores a
text through the same caches (write, then attend, a chunk at a time), for the
perplexity each cache dtype gives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np

from .model import decoder, logits_of, next_tokens, window_of
from .weights import Config


@dataclass(frozen=True)
class Request:
    """Prompt token ids (BOS first), at most ``max_new`` new tokens, and the engine
    step at which the request arrives."""

    id: int
    prompt: tuple[int, ...]
    max_new: int
    arrival: int = 0


@dataclass(frozen=True)
class Timing:
    """One request's wall clock (``time.perf_counter()`` seconds): when it was
    submitted, when its first and last new tokens were decoded, and how many."""

    submitted: float
    first: float
    last: float
    tokens: int

    @property
    def time_to_first_token(self) -> float:
        """Seconds from its submission to its first new token (its prefill)."""
        return self.first - self.submitted

    @property
    def decode_rate(self) -> float:
        """Its new tokens after the first per second (nan for one token)."""
        return (self.tokens - 1) / (self.last - self.first) if self.tokens > 1 else float("nan")


@dataclass
class _Live:
    request: Request
    submitted: float
    pages: list[int] = field(default_factory=list)
    computed: int = 0                      # positions whose K and V are in the cache
    new: list[int] = field(default_factory=list)
    first: float = 0.0                     # when its first new token was decoded

    @property
    def known(self) -> int:                # prompt and generated tokens so far
        return len(self.request.prompt) + len(self.new)

    def token(self, position: int) -> int:
        n = len(self.request.prompt)
        return self.request.prompt[position] if position < n else self.new[position - n]


@dataclass(frozen=True)
class Step:
    """One step: the engine's clock when it ran (arrivals count in it), ``(request id,
    first position, rows)`` per sequence, the padded row count, whether it held
    prompt rows, and its wall time (compilation excluded)."""

    clock: int
    work: tuple[tuple[int, int, int], ...]
    rows: int
    prefill: bool
    seconds: float


class Engine:
    """Serves requests for one model (``params``, ``cfg``, ``dtype``): at most
    ``max_seqs`` at once, each at most ``max_context`` positions long, over
    ``num_pages`` pages of ``page_size`` positions per layer (default: enough for
    ``max_seqs`` requests of ``max_context``); a step runs at most
    ``chunk_budget`` rows (decode rows and prompt chunks: with 2,048, sixteen
    prompts of 128 tokens prefill in one step, whose products run at the speed of
    the machine's largest, where four steps of 512 rows took 25% longer: 1.34 s
    against 1.07 s).
    ``backend``, ``prefer``,
    ``registry``, ``device`` and ``kv_dtype`` (None: the caches hold K and V in
    ``dtype``; "int8", "float8_e4m3fn", "float8_e5m2": quantized) as in
    ``registry.get_paged``."""

    def __init__(self, params: dict[str, Any], cfg: Config, dtype: str, *, max_context: int,
                 page_size: int = 16, max_seqs: int = 8, chunk_budget: int = 2048,
                 num_pages: int | None = None, backend: str | None = None,
                 prefer: str | Sequence[str] | None = None,
                 registry: attn_backends.Registry | None = None, device: Any = None,
                 kv_dtype: str | None = None):
        for name, value in (("max_context", max_context), ("page_size", page_size),
                            ("max_seqs", max_seqs), ("chunk_budget", chunk_budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if chunk_budget < max_seqs:
            raise ValueError(f"chunk_budget: expected at least max_seqs ({max_seqs}), since "
                             f"a step's rows hold a decode row per request, got {chunk_budget}")
        registry = registry if registry is not None else attn_backends.registry
        self.cfg, self.params, self.page_size = cfg, params, page_size
        self.max_seqs, self.chunk_budget, self.max_context = max_seqs, chunk_budget, max_context
        kinds = {window_of(cfg, layer) for layer in range(cfg.layers)}
        # Selection happens here, once per layer kind: caches take the chosen layout.
        self.paged = {w: registry.get_paged(
            device=device, backend=backend, prefer=prefer, num_q_heads=cfg.heads,
            num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, page_size=page_size, dtype=dtype,
            scale=cfg.scale, window=None if w is None else (w, None), kv_dtype=kv_dtype)
            for w in kinds}
        #: What the caches store K and V in: ``dtype``, or the quantized dtype.
        self.kv_dtype = next(iter(self.paged.values())).call.kv_dtype or dtype
        self.table_width = -(-max_context // page_size)
        self.num_pages = num_pages = num_pages or max_seqs * self.table_width
        self.caches = tuple(self.paged[window_of(cfg, layer)].init_cache(num_pages)
                            for layer in range(cfg.layers))
        self.free = list(range(num_pages))[::-1]
        # (params, caches, tokens, positions, slots, batch, last_rows) -> (tokens, caches)
        self.program = jax.jit(self._forward, donate_argnums=1)
        self._scorer = jax.jit(self._score, donate_argnums=1)
        self._compiled: dict[int, Any] = {}
        self.compile_seconds = 0.0
        self.waiting: list[tuple[Request, float]] = []
        self.live: list[_Live] = []
        self.finished: dict[int, list[int]] = {}
        #: Each finished request's :class:`Timing`, by id.
        self.timings: dict[int, Timing] = {}
        self.steps: list[Step] = []
        self.clock = 0

    def reset(self) -> None:
        """Ready the engine to serve again with the programs it compiled: forget the
        finished requests, the steps and the clock, and abandon unfinished ones (a
        stream whose caller stopped reading), their pages back on the free list."""
        for r in self.live:
            self.free += r.pages
        self.live.clear()
        self.waiting.clear()
        self.finished.clear()
        self.timings.clear()
        self.steps.clear()
        self.clock = 0

    def backends(self) -> dict[str, str]:
        """The backend serving each kind of layer: {"local": name, "global": name}."""
        return {"global" if w is None else "local": p.backend.name for w, p in self.paged.items()}

    def bytes_per_token(self) -> float:
        """The bytes every layer's cache keeps per position: K and V (and a quantized
        cache's scales), over the pool."""
        total = sum(a.size * a.dtype.itemsize for c in self.caches for a in c.arrays)
        return total / (self.num_pages * self.page_size)

    def requests_in(self, budget_bytes: int, tokens: int) -> int:
        """How many requests of ``tokens`` positions (whole pages) caches of
        ``budget_bytes`` hold."""
        per_request = -(-tokens // self.page_size) * self.page_size * self.bytes_per_token()
        return int(budget_bytes // per_request)

    def rates(self) -> tuple[float, float]:
        """(prefill, decode) tokens per second over the steps run so far: the rows of
        the steps that held prompt rows, and of those that held decode rows only
        (nan where there were none)."""
        prefill = [s for s in self.steps if s.prefill]
        decode = [s for s in self.steps if not s.prefill]

        def rate(steps: list[Step], rows: Any) -> float:
            seconds = sum(s.seconds for s in steps)
            return sum(rows(s) for s in steps) / seconds if seconds else float("nan")

        return (rate(prefill, lambda s: sum(n for *_, n in s.work)),
                rate(decode, lambda s: len(s.work)))

    def _forward(self, params: dict[str, Any], caches: tuple[Any, ...], tokens: jax.Array,
                 positions: jax.Array, slots: jax.Array, batch: attn_backends.PagedBatch,
                 last_rows: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
        """rows ``[T]`` -> (the greedy token after each sequence's last row ``[max_seqs]``,
        the caches with every row's K and V written)."""
        hidden, written = self._decode(params, caches, tokens, positions, slots, batch)
        return next_tokens(params, hidden[last_rows]), written

    def _decode(self, params: dict[str, Any], caches: tuple[Any, ...], tokens: jax.Array,
                positions: jax.Array, slots: jax.Array, batch: attn_backends.PagedBatch,
                ) -> tuple[jax.Array, tuple[Any, ...]]:
        """rows ``[T]`` -> (the decoder's last hidden states ``[T, E]``, the caches with
        every row's K and V written: each layer writes its rows, then attends)."""
        written = list(caches)

        def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            paged = self.paged[window_of(self.cfg, layer)]
            written[layer] = paged.write(written[layer], k, v, slots)   # write, then attend
            return paged(q, written[layer], batch)

        hidden = decoder(params, self.cfg, tokens, positions, attend)
        return hidden, tuple(written)

    def _score(self, params: dict[str, Any], caches: tuple[Any, ...], tokens: jax.Array,
               positions: jax.Array, slots: jax.Array, batch: attn_backends.PagedBatch,
               targets: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
        """rows ``[T]`` (T a multiple of 64) of one sequence -> (the log-probability of
        ``targets[t]`` after row t ``[T]`` float32, the caches with the rows written).
        The head runs 64 rows at a time: a chunk's logits at once would be its rows
        x 262,144 floats."""
        hidden, written = self._decode(params, caches, tokens, positions, slots, batch)

        def block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
            rows, want = args
            logp = jax.nn.log_softmax(logits_of(params, rows), axis=-1)
            return jnp.take_along_axis(logp, want[:, None], axis=-1)[:, 0]

        blocks = (hidden.reshape(-1, 64, hidden.shape[-1]), targets.reshape(-1, 64))
        return jax.lax.map(block, blocks).reshape(-1), written

    def log_probs(self, ids: Sequence[int]) -> np.ndarray:
        """``log p(ids[t + 1] | ids[: t + 1])`` for every t, float64 ``[len(ids) - 1]``:
        ``ids`` written into this engine's caches and attended a chunk of
        ``chunk_budget`` rows at a time, as a prompt is served. The engine must be
        idle; its pages are free again after."""
        ids = [int(i) for i in ids]
        if self.live or self.waiting:
            raise RuntimeError("log_probs: the engine is serving requests; score on an idle one")
        if not 2 <= len(ids) <= self.max_context:
            raise ValueError(f"ids: expected 2 to {self.max_context} tokens (max_context), "
                             f"got {len(ids)}")
        pages = [self.free.pop() for _ in range(-(-len(ids) // self.page_size))]
        table = np.zeros((1, self.table_width), np.int32)
        table[0, : len(pages)] = pages
        out = []
        try:
            for start in range(0, len(ids) - 1, self.chunk_budget):
                n = min(self.chunk_budget, len(ids) - 1 - start)
                rows = max(64, 1 << (n - 1).bit_length())
                positions = np.arange(start, start + n)
                a = {"tokens": np.zeros(rows, np.int32), "positions": np.zeros(rows, np.int32),
                     "slots": np.full(rows, -1, np.int32), "targets": np.zeros(rows, np.int32)}
                a["tokens"][:n] = ids[start: start + n]
                a["targets"][:n] = ids[start + 1: start + n + 1]
                a["positions"][:n] = positions
                a["slots"][:n] = (table[0, positions // self.page_size] * self.page_size
                                  + positions % self.page_size)
                batch = attn_backends.PagedBatch(
                    jnp.asarray([0, n], jnp.int32), jnp.asarray([start + n], jnp.int32),
                    jnp.asarray(table), jnp.int32(1))
                logp, self.caches = self._scorer(
                    self.params, self.caches, jnp.asarray(a["tokens"]),
                    jnp.asarray(a["positions"]), jnp.asarray(a["slots"]), batch,
                    jnp.asarray(a["targets"]))
                out.append(np.asarray(logp, np.float64)[:n])  # sliced on the host: no program per n
        finally:
            self.free += pages
        return np.concatenate(out)

    def submit(self, request: Request) -> None:
        """Queue a request; it starts when a slot and its pages are free."""
        length = len(request.prompt) + request.max_new - 1
        if not request.prompt or request.max_new < 1 or length > self.max_context:
            raise ValueError(f"request {request.id}: expected a non-empty prompt and 1 <= "
                             f"max_new with prompt + max_new - 1 <= {self.max_context} "
                             f"positions, got {len(request.prompt)} and {request.max_new}")
        pages = self._pages_needed(request)
        if pages > self.num_pages:
            raise ValueError(f"request {request.id} needs {pages} pages of {self.page_size} "
                             f"positions, the pool has {self.num_pages}: make the engine with "
                             "more num_pages")
        self.waiting.append((request, time.perf_counter()))

    def _pages_needed(self, request: Request) -> int:
        """Pages a request holds at its longest (its last new token is never fed back)."""
        return -(-(len(request.prompt) + request.max_new - 1) // self.page_size)

    def _admit(self) -> None:
        """First come, first served, while a slot is free and the free list covers
        every running request's longest length: no request ever waits for a page."""
        owed = sum(self._pages_needed(r.request) - len(r.pages) for r in self.live)
        while self.waiting and len(self.live) < self.max_seqs:
            need = self._pages_needed(self.waiting[0][0])
            if len(self.free) - owed < need:
                break
            owed += need
            self.live.append(_Live(*self.waiting.pop(0)))

    def _plan(self) -> list[tuple[_Live, int]]:
        """Decode rows first (one per request past its prompt), then prompt chunks while
        the step has fewer than ``chunk_budget`` rows."""
        plan = [(r, 1) for r in self.live if r.computed >= len(r.request.prompt)]
        # The budget counts every row, as vLLM's max_num_batched_tokens: a step of
        # 16 decode rows and a 512-row chunk would run in the 1,024-row bucket.
        budget = self.chunk_budget - len(plan)
        for r in self.live:
            remaining = len(r.request.prompt) - r.computed
            if remaining > 0 and budget > 0:
                plan.append((r, min(remaining, budget)))
                budget -= plan[-1][1]
        return plan

    def _arrays(self, plan: list[tuple[_Live, int]]) -> dict[str, np.ndarray]:
        """The ragged batch padded to static shapes: padding rows write nothing (slot
        -1); unused sequences have no rows and no keys; table entries past a
        sequence's pages are 0 and never read."""
        total = sum(n for _, n in plan)
        rows = max(8, 1 << (total - 1).bit_length())
        out = {"tokens": np.zeros(rows, np.int32), "positions": np.zeros(rows, np.int32),
               "slots": np.full(rows, -1, np.int32), "last_rows": np.zeros(self.max_seqs, np.int32),
               "cu": np.full(self.max_seqs + 1, total, np.int32),
               "kv_lens": np.zeros(self.max_seqs, np.int32),
               "table": np.zeros((self.max_seqs, self.table_width), np.int32)}
        row = 0
        for s, (r, n) in enumerate(plan):
            need = -(-(r.computed + n) // self.page_size) - len(r.pages)
            r.pages += [self.free.pop() for _ in range(need)]
            positions = np.arange(r.computed, r.computed + n)
            pages = np.asarray(r.pages)
            out["tokens"][row: row + n] = [r.token(int(p)) for p in positions]
            out["positions"][row: row + n] = positions
            out["slots"][row: row + n] = (pages[positions // self.page_size] * self.page_size
                                          + positions % self.page_size)
            out["cu"][s], out["last_rows"][s] = row, row + n - 1
            out["kv_lens"][s] = r.computed + n
            out["table"][s, : len(pages)] = pages
            row += n
        return out

    def step(self) -> list[tuple[int, int, bool]]:
        """Admit, run one ragged batch, take each sequence's next token if its last
        known token ran, retire the finished (their pages go back). Returns the
        ``(request id, token, whether it is the request's last)`` decoded, in the
        batch's order."""
        self._admit()
        plan = self._plan()
        self.clock += 1
        if not plan and self.waiting and not self.live:
            # every page should be free now: a request that still cannot start
            # would wait forever
            raise RuntimeError(f"request {self.waiting[0][0].id} cannot start with nothing "
                               f"running: {len(self.free)} of {self.num_pages} pages free")
        if not plan:
            return []
        a = self._arrays(plan)
        batch = attn_backends.PagedBatch(jnp.asarray(a["cu"]), jnp.asarray(a["kv_lens"]),
                                         jnp.asarray(a["table"]), jnp.int32(len(plan)))
        args = (self.params, self.caches, jnp.asarray(a["tokens"]), jnp.asarray(a["positions"]),
                jnp.asarray(a["slots"]), batch, jnp.asarray(a["last_rows"]))
        rows = len(a["tokens"])
        if rows not in self._compiled:
            start = time.perf_counter()
            self._compiled[rows] = self.program.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
        start = time.perf_counter()
        next_tokens, self.caches = self._compiled[rows](*args)
        next_tokens = np.asarray(next_tokens)  # waits for the step
        seconds = time.perf_counter() - start
        self.steps.append(Step(self.clock - 1, tuple((r.request.id, r.computed, n)
                                                     for r, n in plan), rows,
                               any(r.computed < len(r.request.prompt) for r, _ in plan), seconds))
        decoded, now = [], time.perf_counter()
        for s, (r, n) in enumerate(plan):
            r.computed += n
            if r.computed == r.known:
                r.new.append(int(next_tokens[s]))
                r.first = r.first or now
                decoded.append((r.request.id, r.new[-1]))
        for r in [r for r in self.live if len(r.new) == r.request.max_new
                  or (r.new and r.new[-1] == self.cfg.eos)]:
            self.live.remove(r)
            self.free += r.pages
            self.finished[r.request.id] = r.new
            self.timings[r.request.id] = Timing(r.submitted, r.first, now, len(r.new))
        return [(i, token, i in self.finished) for i, token in decoded]

    def serve(self, requests: Sequence[Request]) -> Iterator[tuple[int, int, bool]]:
        """Serve ``requests``, each submitted at its arrival step, yielding each
        ``(request id, token, whether it is the request's last)`` as its step
        decodes it (EOS included when a request ends on it)."""
        pending = sorted(requests, key=lambda r: r.arrival)
        while pending or self.waiting or self.live:
            while pending and pending[0].arrival <= self.clock:
                self.submit(pending.pop(0))
            yield from self.step()

    def run(self, requests: Sequence[Request]) -> dict[int, list[int]]:
        """Serve ``requests`` (as :meth:`serve`): their new tokens by id."""
        for _ in self.serve(requests):
            pass
        return {r.id: self.finished[r.id] for r in requests}
