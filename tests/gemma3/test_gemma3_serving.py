"""The continuous-batching engine serving Gemma 3 a real workload: prompts of 10 to
4,000 tokens arriving over time, prompt chunks and decode rows in one ragged batch,
pages back in the free list when a request ends, and every completion identical
to the same request served alone."""

from __future__ import annotations

import numpy as np
import pytest
from attn_gemma3 import Request

pytestmark = pytest.mark.slow(seconds=60)

WORDS = ("the river ran past a mill where the miller kept seven cats and one old dog "
         "that barked at every boat coming down from the hills in spring").split()


def _prompt(model, tokens: int, seed: int) -> tuple[int, ...]:
    """A prompt of exactly ``tokens`` ids (BOS first) of plain English words."""
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(WORDS, size=tokens))
    ids = model.tokenize(text)[:tokens]
    assert len(ids) == tokens
    return tuple(ids)


def test_requests_arriving_over_time_equal_each_served_alone(model):
    # A prompt of 2,000 tokens: chunks of the budget of 512 rows, past the local
    # layers' window of 512 (4,000 tokens took 76 s in make test; 2,000 take 31 s
    # alone). Served alone below, it takes the default budget of 2,048 rows.
    lengths, arrivals = (10, 2000, 37, 700, 120), (0, 1, 1, 3, 9)
    requests = [Request(i, _prompt(model, n, i), max_new=6, arrival=a)
                for i, (n, a) in enumerate(zip(lengths, arrivals, strict=True))]
    engine = model.engine(2016, page_size=16, max_seqs=4, chunk_budget=512,
                          num_pages=175)
    together = engine.run(requests)
    # prompt chunks of the long prompt beside other requests' decode rows
    mixed = [s for s in engine.steps if s.prefill and any(n == 1 for _, _, n in s.work)]
    assert mixed, [s.work for s in engine.steps]
    # chunked prefill: the 2,000-token prompt fills steps to the budget, which
    # counts the decode rows beside its chunk too
    assert max(s.rows for s in engine.steps) <= 512
    assert any(sum(n for *_, n in s.work) == 512 and any(n == 1 for *_, n in s.work)
               for s in engine.steps)
    # 5 requests for 4 slots, and a pool smaller than their 183 pages: some request
    # started after it arrived, and never more than 4 ran in a step
    first = {}
    for step in engine.steps:
        for rid, _, _ in step.work:
            first.setdefault(rid, step.clock)
    assert any(first[r.id] > r.arrival for r in requests), first
    assert max(len(s.work) for s in engine.steps) <= 4
    assert len(engine.free) == 175 and not engine.live
    alone = model.engine(2016, page_size=16, max_seqs=1)  # one request at a time
    for r in requests:
        assert together[r.id] == alone.run([Request(r.id, r.prompt, 6)])[r.id], r.id
        assert len(together[r.id]) == 6 or together[r.id][-1] == model.cfg.eos


def test_pages_return_and_are_reused_with_garbage_in_them(model):
    # a pool just big enough for one request at a time: the second request's
    # pages are the first's, holding its keys; both equal serving them alone
    engine = model.engine(64, page_size=16, max_seqs=2, num_pages=4)
    first, second = _prompt(model, 50, 1), _prompt(model, 45, 2)
    out = engine.run([Request(0, first, 8), Request(1, second, 8)])
    steps = [{rid for rid, _, _ in s.work} for s in engine.steps]
    assert not any(steps_with_both := [s for s in steps if s == {0, 1}]), steps_with_both
    assert sorted(engine.free) == [0, 1, 2, 3]
    fresh = model.engine(64, page_size=16, max_seqs=1).run([Request(1, second, 8)])
    assert out[1] == fresh[1]
