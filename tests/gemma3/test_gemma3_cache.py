"""The dequantized weights and the tokenizer as a user lives with them: one cache
folder, loaded again by later processes, never dequantized or built twice."""

from __future__ import annotations

import os

import attn_gemma3
import gguf
import numpy as np


def test_a_second_load_reads_the_cache_and_never_the_gguf_tensors(model, monkeypatch):
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the GGUF was read again: the cache was not used")

    # the session's model filled this folder; a later load must come from it alone
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    again = attn_gemma3.load(dtype="float32", cache_dir=os.environ.get("ATTN_GEMMA3_CACHE"))
    assert again.cfg == model.cfg
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(again.params[name], model.params[name])
    for ours, theirs in zip(again.params["layers"], model.params["layers"], strict=True):
        for name in ours:
            np.testing.assert_array_equal(ours[name], theirs[name])
    text = "Caches are product behaviour: 東京, tabs\tand  spaces."
    assert again.tokenize(text) == model.tokenize(text)
    ids = model.tokenize("The capital of France is")
    np.testing.assert_array_equal(again.logits(ids, last=2), model.logits(ids, last=2))

