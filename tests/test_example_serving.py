"""examples/serving: continuous batching over the paged cache decodes, token for
token, what the same model decodes for each request alone without a cache.

Five requests (prompts of 3 to 20 characters, 8 new tokens each) arrive two
steps apart into a pool too small for all of them at once, so requests wait
for pages and reuse the pages of those that left; each step packs decode rows
and prefill chunks (at most 8 prompt tokens a step) into one ragged batch. Run
on every backend that serves this paged call on cpu (the Pallas ones in
interpret mode, when they declare paged support). The summary line the demo
ends with counts what the engine served.
"""

from __future__ import annotations

import attn_backends as ab
import jax
import jax.numpy as jnp
import pytest
from _paged_support import INTERPRET, paged_servers
from _support import load_example

serve = load_example("serving/serve.py", "serving_example")

CFG = serve.CONFIG
REGISTRY = ab.Registry(probe=None)
PAGE_SIZE, NUM_PAGES, MAX_SEQS, CHUNK = 4, 12, 4, 8
PAGED_CALL = dict(num_q_heads=CFG.heads, num_kv_heads=CFG.kv_heads,
                  head_dim=CFG.d_model // CFG.heads, page_size=PAGE_SIZE, dtype="float32")
BACKENDS = paged_servers(REGISTRY, "cpu", **PAGED_CALL)


def test_every_paged_backend_serves_the_example_on_cpu() -> None:
    assert {"reference", "xla_native"} <= set(BACKENDS), BACKENDS
    # A Pallas backend that serves this call on its own platform serves it on
    # cpu in interpret mode too, so the token-for-token test below runs it.
    for name, platform in (("flash_pallas", "tpu"), ("flash_triton", "gpu")):
        if name in REGISTRY.backends and name in paged_servers(REGISTRY, platform, **PAGED_CALL):
            assert name in BACKENDS, f"{name} serves {platform} but not cpu in interpret mode"


@pytest.fixture(scope="module")
def model():
    _, vocab = serve.transformer.load_corpus()
    return serve.transformer.init_state(CFG, vocab), vocab


@pytest.fixture(scope="module")
def requests():
    return serve.demo_requests(lengths=(3, 20, 7, 12, 5), max_new=8)


@pytest.fixture(scope="module")
def alone(model, requests):
    params, vocab = model
    return {r.id: serve.decode_alone(params, vocab, r.prompt, r.max_new) for r in requests}


def _load_first(backend: str) -> None:
    """Run one call of an emulated Pallas kernel or of a tokamax backend: the
    kernel's first run loads JAX's interpreter, tokamax's first call imports
    tokamax (and Pallas), and either defines config options that grow JAX's
    tracing context, so the next call of any jitted function retraces once. After
    this the engine's compile count is its own."""
    paged = REGISTRY.get_paged(device="cpu", backend=backend, **PAGED_CALL)
    q = jnp.zeros((1, PAGED_CALL["num_q_heads"], PAGED_CALL["head_dim"]), jnp.float32)
    batch = ab.PagedBatch(jnp.array([0, 1]), jnp.array([1]), jnp.zeros((1, 1), jnp.int32),
                          jnp.int32(1))
    jax.block_until_ready(jax.jit(paged.__call__)(q, paged.init_cache(1), batch))


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_decodes_what_each_request_decodes_alone(backend, model, requests, alone,
                                                       monkeypatch) -> None:
    for name in INTERPRET:
        monkeypatch.setenv(name, "1")
    if backend in ("flash_pallas", "flash_triton") or backend.startswith("tokamax_"):
        _load_first(backend)
    params, vocab = model
    engine = serve.Engine(params, vocab, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                          max_seqs=MAX_SEQS, chunk_budget=CHUNK, device="cpu",
                          backend=backend, registry=REGISTRY)
    outputs = engine.run(requests)
    assert outputs == alone

    # The structure the equality has to hold through.
    prompt = {r.id: len(r.prompt) for r in requests}
    kinds = [{"decode" if p >= prompt[i] else "prefill" for i, p, _ in rec.work}
             for rec in engine.records]
    assert {"decode", "prefill"} in kinds, "no step mixes prefill chunks and decode rows"
    longest = max(prompt, key=prompt.get)
    chunks = [n for rec in engine.records for i, p, n in rec.work if i == longest and p < prompt[i]]
    assert len(chunks) >= 3 and max(chunks) <= CHUNK, chunks
    first = {}
    for rec in engine.records:
        for i, _, _ in rec.work:
            first.setdefault(i, rec.step)
    assert any(first[r.id] > r.arrival for r in requests), "no request waited"
    # Together they need more pages than the pool has: served only by reusing pages.
    assert sum(serve.pages_needed(r, PAGE_SIZE) for r in requests) > NUM_PAGES
    assert sorted(engine.free) == list(range(NUM_PAGES)), "pages not all returned"
    # Rows are padded to a few static sizes: one compiled program per size.
    assert engine._step._cache_size() == len({rec.rows for rec in engine.records}) <= 2

    # The summary the demo ends with. Every row that ran held a prompt token or a
    # generated one fed back (each request's last token is not).
    summary = serve.summarize(engine, requests, outputs)
    prompt_tokens = sum(prompt.values())
    assert (summary.requests, summary.new_tokens, summary.prompt_tokens) == (5, 40, prompt_tokens)
    assert summary.row_occupancy == (prompt_tokens + 40 - 5) / sum(r.rows for r in engine.records)
    assert 0 < summary.seq_occupancy <= 1 and summary.steps == len(engine.records)
    assert 0 < summary.step_seconds < max(r.seconds for r in engine.records)
    line = summary.line()
    assert line.startswith("summary: 40 tokens served") and f"backend {backend} (" in line


def test_an_int8_cache_serves_each_request_as_alone_and_says_its_bytes(model, requests) -> None:
    """Over an int8 cache (values and a scale per position and head), a request
    served beside others gets the tokens it gets alone; the summary counts the
    cache's bytes: a quarter of float32's values plus 4 bytes of scale."""
    params, vocab = model
    options = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES, chunk_budget=CHUNK, device="cpu",
                   backend="xla_native", registry=REGISTRY, kv_dtype="int8")
    engine = serve.Engine(params, vocab, max_seqs=MAX_SEQS, **options)
    outputs = engine.run(requests)
    for r in requests[:2]:
        alone = serve.Engine(params, vocab, max_seqs=1, **options).run(
            [serve.Request(r.id, r.prompt, r.max_new)])
        assert alone[r.id] == outputs[r.id]
    summary = serve.summarize(engine, requests, outputs)
    dim = CFG.d_model // CFG.heads
    assert summary.kv_dtype == "int8"
    assert summary.bytes_per_token == CFG.layers * 2 * CFG.kv_heads * (dim + 4)
    assert "cache int8" in summary.line()
