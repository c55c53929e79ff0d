"""A small continuous-batching engine over examples/transformer's character model,
attending through the registry's paged KV-cache contract.

Requests with different prompt lengths arrive at different steps and leave when
they have their tokens. The cache is one pool of ``page_size``-token pages per
layer, shared by every request: a request takes pages from a free list as it
grows and gives them back when it leaves. Each step packs decode steps (one
token per running request) and prefill chunks (at most ``chunk_budget`` prompt
tokens per step, so a long prompt spans several steps) into ONE ragged batch,
writes the new tokens' K and V (``paged.write``) and attends (``paged(q, cache,
batch)``) in every layer, then decodes greedily.

    python examples/serving/serve.py --backend xla_native

The model is the example's own (imported, not copied): ``train.py --serving``
trains it into a checkpoint, which this loads (training it first when it is
missing or stale). Greedy equality with decoding each request alone needs no
trained model (the tests serve its random initialisation); trained, its
completions read like the corpus. At the end, one line sums up what was
served. README.md (beside this file) walks through the contract.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _load_transformer() -> Any:
    """examples/transformer/train.py as a module (the examples are scripts, not packages)."""
    name = "examples_transformer_train"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "transformer",
                            "train.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


transformer = _load_transformer()

#: The serving model: the example's architecture, shorter (positions 0 .. seq-1:
#: a prompt plus its new tokens must fit). Head dim 64 (2:1 GQA).
CONFIG = transformer.SERVING
#: The cache budget the summary counts requests in (this model's caches are small).
BUDGET = 1 << 20


@dataclass(frozen=True)
class Request:
    """A prompt (character ids), how many tokens to generate, and the engine step
    at which it arrives."""

    id: int
    prompt: tuple[int, ...]
    max_new: int
    arrival: int = 0


@dataclass
class Running:
    """A request being served: its pages, and how many of its tokens have their
    K and V in the cache (``computed``); the rest of ``tokens`` still has to run."""

    request: Request
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    generated: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [*self.request.prompt, *self.generated]

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.prompt)


@dataclass(frozen=True)
class StepRecord:
    """What one engine step ran: ``(request id, first position, rows)`` per
    sequence in batch order, the padded row count (the compiled bucket), and the
    step's wall time in seconds (the jitted call until its tokens are back)."""

    step: int
    work: tuple[tuple[int, int, int], ...]
    rows: int
    seconds: float


def pages_needed(request: Request, page_size: int) -> int:
    """Pages a request holds at its longest: its prompt and every generated token
    but the last, which is returned without being fed back."""
    return -(-(len(request.prompt) + request.max_new - 1) // page_size)


class Engine:
    """Continuous batching over a paged KV cache, one cache (``KVCache``) per layer.

    ``params``: the model's parameters (``transformer.init_state``); ``num_pages``
    pages of ``page_size`` positions per layer; at most ``max_seqs`` requests run
    at once; each step adds at most ``chunk_budget`` prompt tokens. The ragged
    batch is padded to static shapes: ``max_seqs`` table rows of ``seq /
    page_size`` pages, and the rows (tokens) to a power of two, so the step
    compiles once per row bucket.

    With ``mesh``, every layer's attention and cache are split by kv heads over
    its axis ``heads_axis`` (``shard_paged_heads``: each device attends its own
    heads, no collective); the mesh may span the devices of every process of a
    multi-process run, each process running the same engine on the same requests.
    """

    def __init__(self, params: nnx.State, vocab: int, *, cfg: Any = CONFIG, page_size: int = 4,
                 num_pages: int = 32, max_seqs: int = 4, chunk_budget: int = 8,
                 device: Any = None, backend: str | None = None,
                 registry: attn_backends.Registry | None = None, mesh: Any = None,
                 heads_axis: str = "tp", kv_dtype: str | None = None):
        registry = registry if registry is not None else attn_backends.registry
        self._by_heads: Any = lambda x: x  # where each device's heads are: one device
        self.cfg, self.page_size, self.max_seqs = cfg, page_size, max_seqs
        self.chunk_budget = chunk_budget
        # Selection happens here, once: the cache is made in the chosen backend's layout.
        self.paged = registry.get_paged(
            device=device, backend=backend, num_q_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
            head_dim=cfg.d_model // cfg.heads, page_size=page_size, dtype="float32",
            kv_dtype=kv_dtype)
        #: What the caches hold K and V in: float32, or a quantized dtype.
        self.kv_dtype: str = self.paged.call.kv_dtype or "float32"
        self.backend: str = self.paged.backend.name  # sharded below or not, this one serves
        if mesh is not None:
            from attn_backends.parallel.paged import shard_paged_heads

            self.paged = shard_paged_heads(self.paged, mesh, heads_axis)
            # The same weights on every device of the mesh, whichever process holds it.
            everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            params = jax.tree.map(lambda x: jax.device_put(np.asarray(x), everywhere), params)
            by_heads = jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(None, heads_axis, None))
            self._by_heads = functools.partial(jax.reshard, out_shardings=by_heads)
        self.caches = tuple(self.paged.init_cache(num_pages) for _ in range(cfg.layers))
        self.free = list(range(num_pages))[::-1]  # pop() hands out page 0 first
        self.num_pages = num_pages
        self.table_width = -(-cfg.seq // page_size)
        self.params = params
        abstract = nnx.eval_shape(
            lambda: transformer.Model(cfg, vocab, nnx.dot_product_attention, nnx.Rngs(0)))
        self.graphdef, _ = nnx.split(abstract, nnx.Param)
        # The caches are donated: each step updates them in place.
        self._step = jax.jit(self._forward, donate_argnums=1)
        self.waiting: list[Request] = []
        self.running: list[Running] = []
        self.finished: dict[int, list[int]] = {}
        self.records: list[StepRecord] = []
        self.clock = 0

    def _forward(self, params: nnx.State, caches: tuple[Any, ...], tokens: jax.Array,
                 positions: jax.Array, slots: jax.Array, batch: attn_backends.PagedBatch,
                 ) -> tuple[jax.Array, tuple[Any, ...]]:
        """tokens, positions, slots ``[T]`` int32 -> (greedy next token ``[T]``, caches).

        The model's own modules, but attention through the paged cache: every
        layer writes the new rows' K and V, then attends over its cache.
        """
        model = nnx.merge(self.graphdef, params)
        x = model.embed(tokens) + model.position(positions)            # [T, d_model]
        written = []
        for block, cache in zip(model.blocks, caches, strict=True):
            h = block.norm1(x)
            attn = block.attn
            q, k, v = attn.query(h), attn.key(h), attn.value(h)       # [T, H(kv), D]
            q, k, v = (self._by_heads(x) for x in (q, k, v))
            cache = self.paged.write(cache, k, v, slots)             # write, then attend
            x = x + attn.out(self.paged(q, cache, batch))
            x = block.feed_forward(x)
            written.append(cache)
        logits = model.head(model.norm(x))                             # [T, vocab]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), tuple(written)

    def submit(self, request: Request) -> None:
        """Queue a request; it starts when a slot and its pages are free."""
        if len(request.prompt) + request.max_new > self.cfg.seq:
            raise ValueError(f"request {request.id}: prompt ({len(request.prompt)}) + max_new "
                             f"({request.max_new}) must be at most the model's {self.cfg.seq} "
                             "positions")
        if not request.prompt or request.max_new < 1:
            raise ValueError(f"request {request.id}: expected a non-empty prompt and "
                             f"max_new >= 1, got {len(request.prompt)} and {request.max_new}")
        self.waiting.append(request)

    def _admit(self) -> None:
        """Start waiting requests, first come first served, while a slot is free and
        the free list covers what every running request may still take: pages are
        taken as a request grows, so none ever waits for one (no preemption)."""
        owed = sum(pages_needed(r.request, self.page_size) - len(r.pages) for r in self.running)
        while self.waiting and len(self.running) < self.max_seqs:
            need = pages_needed(self.waiting[0], self.page_size)
            if len(self.free) - owed < need:
                break
            owed += need
            self.running.append(Running(self.waiting.pop(0)))

    def _schedule(self) -> list[tuple[Running, int]]:
        """(request, rows) for this step: a decode row for every request past its
        prompt, then prefill chunks within ``chunk_budget``."""
        work = [(r, 1) for r in self.running if not r.prefilling]
        budget = self.chunk_budget
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(len(r.request.prompt) - r.computed, budget)
                work.append((r, n))
                budget -= n
        return work

    def _pack(self, work: list[tuple[Running, int]]) -> tuple[np.ndarray, ...]:
        """The ragged batch's arrays, padded to static shapes: tokens, positions and
        slots ``[T]`` (padding rows: slot -1, nothing written), ``cu_q_lens``
        ``[max_seqs+1]``, ``kv_lens`` ``[max_seqs]``, ``page_table`` ``[max_seqs,
        table_width]`` (entries past a sequence's pages and unused rows: 0, never read)."""
        total = sum(n for _, n in work)
        rows = max(8, 1 << (total - 1).bit_length())
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        slots = np.full(rows, -1, np.int32)
        cu = np.full(self.max_seqs + 1, total, np.int32)
        kv_lens = np.zeros(self.max_seqs, np.int32)
        table = np.zeros((self.max_seqs, self.table_width), np.int32)
        row = 0
        for s, (r, n) in enumerate(work):
            start = r.computed
            while len(r.pages) * self.page_size < start + n:  # grow from the free list
                r.pages.append(self.free.pop())
            pos = np.arange(start, start + n)
            tokens[row: row + n] = r.tokens[start: start + n]
            positions[row: row + n] = pos
            slots[row: row + n] = (np.asarray(r.pages)[pos // self.page_size] * self.page_size
                                   + pos % self.page_size)
            cu[s] = row
            kv_lens[s] = start + n  # the rows' own keys included: written before attending
            table[s, : len(r.pages)] = r.pages
            row += n
        return tokens, positions, slots, cu, kv_lens, table

    def step(self) -> None:
        """One engine step: admit, pack one ragged batch, run it, take the new tokens,
        retire the requests that are done (their pages go back to the free list)."""
        self._admit()
        work = self._schedule()
        self.clock += 1
        if not work:
            return
        tokens, positions, slots, cu, kv_lens, table = self._pack(work)
        batch = attn_backends.PagedBatch(jnp.asarray(cu), jnp.asarray(kv_lens),
                                         jnp.asarray(table), jnp.int32(len(work)))
        start = time.perf_counter()
        next_tokens, self.caches = self._step(self.params, self.caches, jnp.asarray(tokens),
                                              jnp.asarray(positions), jnp.asarray(slots), batch)
        next_tokens = np.asarray(next_tokens)  # waits for the step
        self.records.append(StepRecord(self.clock - 1, tuple(
            (r.request.id, r.computed, n) for r, n in work), len(tokens),
            time.perf_counter() - start))
        for s, (r, n) in enumerate(work):
            r.computed += n
            if r.computed == len(r.tokens):  # its last known token ran: the next one is out
                r.generated.append(int(next_tokens[cu[s] + n - 1]))
        for r in [r for r in self.running if len(r.generated) == r.request.max_new]:
            self.running.remove(r)
            self.free.extend(r.pages)
            self.finished[r.request.id] = r.generated

    def run(self, requests: Sequence[Request]) -> dict[int, list[int]]:
        """Serve ``requests``, each submitted at its arrival step; their new tokens by id."""
        pending = sorted(requests, key=lambda r: r.arrival)
        while pending or self.waiting or self.running:
            while pending and pending[0].arrival <= self.clock:
                self.submit(pending.pop(0))
            self.step()
        return dict(self.finished)


@dataclass(frozen=True)
class Summary:
    """What an engine served: new tokens and prompt tokens, over ``steps`` steps;
    batch occupancy over all steps, the share of the padded rows that held tokens
    and of the ``max_seqs`` sequence slots that held requests; the median wall time
    of a step that compiled nothing (the first step of each row bucket compiles)."""

    requests: int
    new_tokens: int
    prompt_tokens: int
    steps: int
    row_occupancy: float
    seq_occupancy: float
    step_seconds: float
    backend: str
    layout: str
    kv_dtype: str
    bytes_per_token: float
    requests_in_budget: int

    def line(self) -> str:
        return (f"summary: {self.new_tokens} tokens served ({self.prompt_tokens} prompt tokens "
                f"in) to {self.requests} requests in {self.steps} steps; batch occupancy "
                f"{self.row_occupancy:.0%} of rows, {self.seq_occupancy:.0%} of sequence slots; "
                f"{1e3 * self.step_seconds:.1f} ms per step (median of the steps that compiled "
                f"nothing); backend {self.backend} ({self.layout} layout); cache "
                f"{self.kv_dtype}, {self.bytes_per_token:.0f} bytes per token: "
                f"{self.requests_in_budget} requests of {CONFIG.seq} tokens in 1 MiB")


def summarize(engine: Engine, requests: Sequence[Request],
              outputs: dict[int, list[int]]) -> Summary:
    """The ``Summary`` of ``engine.run(requests)``, which returned ``outputs``."""
    records = engine.records
    buckets: set[int] = set()
    warm = []  # steps whose row bucket had compiled before
    # Every layer's cache over its pool: values and any scales, per position.
    per_token = sum(a.size * a.dtype.itemsize for c in engine.caches for a in c.arrays) / (
        engine.num_pages * engine.page_size)
    for r in records:
        if r.rows in buckets:
            warm.append(r.seconds)
        buckets.add(r.rows)
    return Summary(
        requests=len(requests),
        new_tokens=sum(map(len, outputs.values())),
        prompt_tokens=sum(len(r.prompt) for r in requests),
        steps=len(records),
        row_occupancy=sum(n for r in records for *_, n in r.work) / sum(r.rows for r in records),
        seq_occupancy=sum(len(r.work) for r in records) / (len(records) * engine.max_seqs),
        step_seconds=float(np.median(warm or [r.seconds for r in records])),
        backend=engine.backend, layout=engine.paged.layout, kv_dtype=engine.kv_dtype,
        bytes_per_token=per_token, requests_in_budget=int(BUDGET // (per_token * CONFIG.seq)))


def decode_alone(params: nnx.State, vocab: int, prompt: Sequence[int], max_new: int,
                 cfg: Any = CONFIG) -> list[int]:
    """The same model decoding one request by itself, greedily, without any cache:
    the whole sequence runs again for every token, through flax's own attention
    (the baseline the engine must equal, token for token)."""
    run = _full_forward(cfg, vocab)
    tokens = list(prompt)
    for _ in range(max_new):
        padded = np.zeros((1, cfg.seq), np.int32)  # causal: the padding after is never seen
        padded[0, : len(tokens)] = tokens
        tokens.append(int(run(params, jnp.asarray(padded))[len(tokens) - 1]))
    return tokens[len(prompt):]


@functools.cache
def _full_forward(cfg: Any, vocab: int) -> Any:
    """jit(params, tokens [1, seq] -> greedy next token at every position [seq])."""
    abstract = nnx.eval_shape(
        lambda: transformer.Model(cfg, vocab, nnx.dot_product_attention, nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract, nnx.Param)

    @jax.jit
    def run(params: nnx.State, tokens: jax.Array) -> jax.Array:
        return jnp.argmax(nnx.merge(graphdef, params)(tokens)[0], axis=-1)

    return run


def demo_requests(lengths: Sequence[int] = (3, 20, 7, 12, 5), max_new: int = 8,
                  seed: int = 0) -> list[Request]:
    """Prompts of ``lengths`` characters from the corpus, arriving two steps apart."""
    data, _ = transformer.load_corpus()
    starts = np.random.default_rng(seed).integers(0, len(data) - max(lengths), len(lengths))
    return [Request(i, tuple(int(t) for t in data[s: s + n]), max_new, arrival=2 * i)
            for i, (s, n) in enumerate(zip(starts, lengths, strict=True))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default=None, help="a paged backend (default: the registry's)")
    parser.add_argument("--kv-dtype", default=None,
                        choices=("int8", "float8_e4m3fn", "float8_e5m2"),
                        help="store the KV cache quantized (default: float32)")
    parser.add_argument("--checkpoint", default=transformer.SERVING_CHECKPOINT,
                        help="the trained model (train.py --serving; default: %(default)s)")
    args = parser.parse_args()
    _, vocab = transformer.load_corpus()
    steps = transformer.SERVING_STEPS
    weights = transformer.trained_params(CONFIG, steps, args.checkpoint, log_every=steps // 10)
    print(f"model: {os.path.relpath(args.checkpoint)} ({steps} steps, loss {weights.loss:.4f})")
    params = weights.params
    engine = Engine(params, vocab, backend=args.backend, kv_dtype=args.kv_dtype)
    requests = demo_requests(max_new=12)  # the longest prompt, 20, fills the 32 positions
    outputs = engine.run(requests)
    for record in engine.records:
        parts = [f"r{i}:{'decode' if n == 1 and p >= len(requests[i].prompt) else 'prefill'}"
                 f"@{p}+{n}" for i, p, n in record.work]
        print(f"step {record.step:2d}  rows {record.rows:2d}  " + "  ".join(parts))
    with open(transformer.CORPUS, encoding="utf-8") as f:
        chars = sorted(set(f.read()))  # the ids of load_corpus
    differ = []
    for r in requests:
        same = decode_alone(params, vocab, r.prompt, r.max_new) == outputs[r.id]
        differ += [] if same else [r.id]
        print(f"request {r.id}: {''.join(chars[t] for t in r.prompt)!r} -> "
              f"{''.join(chars[t] for t in outputs[r.id])!r} "
              f"({'the same as' if same else 'NOT'} decoded alone)")
    print(summarize(engine, requests, outputs).line())
    # Decoding alone keeps float32 K and V: over a quantized cache a token may
    # differ where two were nearly tied, so only a float32 cache must match.
    if differ and args.kv_dtype is None:
        sys.exit(f"requests {differ}: the engine's tokens differ from decoding each alone")


if __name__ == "__main__":
    main()
