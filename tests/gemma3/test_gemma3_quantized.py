"""Gemma 3 served over quantized KV caches (issue 48): the int8 cache keeps the
model's perplexity on a fixed text within 2% of its float32 cache's, scored
through the engine's paged caches a chunk at a time (past the 512-key window of
the local layers); each cache says its bytes per token and how many requests a
memory budget holds; a request served beside others over an int8 cache gets the
tokens it gets alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from attn_gemma3 import Request

#: Started early under make test's two workers, by its seconds there.
pytestmark = pytest.mark.slow(seconds=40)

TEXT = Path(__file__).parents[2] / "examples" / "gemma3" / "texts" / "python_execution_model.txt"
#: Tokens scored: past one local window (512 keys), two chunks of 512 rows.
TOKENS = 700


def test_an_int8_cache_keeps_the_perplexity_in_half_the_bytes(model) -> None:
    ids = model.tokenize(TEXT.read_text())[:TOKENS]
    plain = model.perplexity(ids)
    engine = model.last_engine
    assert engine.kv_dtype == "float32"
    # 18 layers x K and V x 1 kv head x 256 dims x 4 bytes.
    assert engine.bytes_per_token() == 18 * 2 * 256 * 4
    assert engine.requests_in(256 << 20, 4096) == 1
    int8 = model.perplexity(ids, kv_dtype="int8")
    engine = model.last_engine
    assert engine.kv_dtype == "int8"
    assert set(engine.backends().values()) == {"native_cpu"}
    # Values of one byte and a float32 scale per position and head.
    assert engine.bytes_per_token() == 18 * 2 * (256 + 4)
    assert engine.requests_in(256 << 20, 4096) == 7
    assert 5 < plain < 50, plain  # the text is natural English prose with code
    # 1.1% measured here (float32 model, 700 tokens); the aim of 1% against a
    # bfloat16 cache is measured over the whole text in BENCHMARKS.md.
    assert abs(int8 / plain - 1) < 0.02, (plain, int8)


def test_requests_served_together_over_an_int8_cache_equal_each_alone(model) -> None:
    prompts = [model.tokenize(t) for t in ("The capital of France is",
                                           "def fibonacci(n):", "Once upon a time")]
    requests = [Request(i, tuple(p), 6, arrival=i) for i, p in enumerate(prompts)]
    together = model.engine(64, max_seqs=3, kv_dtype="int8").run(requests)
    for r in requests:
        alone = model.engine(64, max_seqs=1, kv_dtype="int8").run([Request(r.id, r.prompt, 6)])
        assert together[r.id] == alone[r.id], (r.id, together[r.id], alone[r.id])
