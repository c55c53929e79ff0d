"""Gemma 3 as users call it: a model compiles once (a second generate, stream or
perplexity of the same size compiles nothing), streams its text as it decodes
(multi-byte characters whole), and the command line labels its figures."""

from __future__ import annotations

import contextlib

import jax
import pytest
from attn_gemma3 import __main__ as cli
from attn_gemma3.api import IncrementalText

#: JAX's event for each program XLA compiles (jax._src.dispatch.BACKEND_COMPILE_EVENT).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiles():
    """The programs XLA compiles inside, counted by JAX's own monitoring event."""
    seen: list[str] = []

    def listen(event: str, seconds: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_second_call_of_the_same_size_compiles_nothing(model):
    prompt = "Once upon a time, in a small village by the sea, there lived"
    first = model.generate([prompt], max_new_tokens=8)
    engine = model.last_engine
    with compiles() as counted:
        again = model.generate([prompt], max_new_tokens=8)
        other = model.generate(["The capital of France is"], max_new_tokens=12)
        streamed = "".join(text for _, text in model.stream([prompt], max_new_tokens=8))
    assert counted == [] and model.last_engine is engine
    assert again == first and streamed == first[0] and other[0]
    model.perplexity("The quick brown fox jumps over the lazy dog.")
    with compiles() as counted:
        model.perplexity("A second sentence of about the same length, scored.")
    assert counted == []


def test_a_stream_left_unread_frees_its_engine_for_the_next_call(model):
    prompt = "Once upon a time, in a small village by the sea, there lived"
    whole = model.generate([prompt], max_new_tokens=8)
    engine = model.last_engine
    stream = model.stream([prompt], max_new_tokens=8)
    next(stream)
    stream.close()  # the caller stops reading: its request is still live
    assert engine.live
    with compiles() as counted:
        assert model.generate([prompt], max_new_tokens=8) == whole
    assert counted == [] and sorted(engine.free) == list(range(engine.num_pages))


def test_the_teeth_a_fresh_engine_compiles(model):
    model.generate(["Hello"], max_new_tokens=4)
    with compiles() as counted:
        model.engine(256, max_seqs=1).run([])  # built, never stepped: nothing yet
        fresh = model.engine(256, max_seqs=1)
        from attn_gemma3 import Request

        fresh.run([Request(0, tuple(model.tokenize("Hello")), 4)])
    assert len(counted) >= 1


def test_incremental_text_holds_a_character_back_until_its_last_byte():
    # One token per UTF-8 byte, as a tokenizer's byte fallback gives them.
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    text = "añ€😀!"
    stream = IncrementalText(decode)
    pieces = [stream.add(b) for b in text.encode()]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) + stream.finish() == text
    assert pieces[:4] == ["a", "", "ñ", ""]  # ñ is 2 bytes: nothing after its first
    cut = IncrementalText(decode)  # a request cut inside a character: finish gives it
    assert [cut.add(b) for b in "€".encode()[:2]] == ["", ""] and cut.finish() == "\ufffd"


@pytest.mark.parametrize("prompts", [
    ["Translate to Japanese: good morning ->", "Le café de la gare est", "Emoji: 😀 🎉 and"],
])
def test_streamed_text_equals_the_returned_text(model, prompts):
    returned = model.generate(prompts, max_new_tokens=24)
    streamed = [""] * len(prompts)
    order = []
    for index, text in model.stream(prompts, max_new_tokens=24):
        assert "\ufffd" not in text  # never half a character
        streamed[index] += text
        order.append(index)
    assert streamed == returned
    assert any(ord(c) > 127 for text in returned for c in text)  # multi-byte text served
    assert len(set(order[:len(prompts)])) > 1  # interleaved as decoded, not one by one


def test_the_command_line_labels_per_request_and_aggregate_figures(capsys):
    assert cli.main(["--max-new-tokens", "6", "The capital of France is", "def add(a, b):"]) == 0
    out = capsys.readouterr().out
    for rid in (0, 1):
        assert f"request {rid}: time to first token " in out
    assert "all 2 requests together: " in out and "tokens/s aggregate" in out
    assert "wall time of the call: " in out
    assert cli.main(["--max-new-tokens", "6", "The capital of France is"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("'The capital of France is' -> ") and len(lines[0]) > 30
    assert lines[1].startswith("request 0: time to first token ")
