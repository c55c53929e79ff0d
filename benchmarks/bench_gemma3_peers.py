"""Prefill and decode speed of two peer runtimes for Gemma 3 270M on CPU, from one GGUF file.

Run with the peer venv (torch CPU, transformers, gguf, llama-cpp-python), never the
project's own:

    .venv-peer/bin/python benchmarks/bench_gemma3_peers.py MODEL.gguf --json OUT.json
    .venv-peer/bin/python benchmarks/bench_gemma3_peers.py MODEL.gguf --json OUT.json --quick

Peers, each on 2 threads:

* transformers (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=...)``,
  its default attention implementation, sdpa), in float32 and in bfloat16: transformers'
  own GGUF loader dequantizes the weights to that dtype. ``torch.set_num_threads(2)``.
* llama.cpp through llama-cpp-python's ``Llama``, on the GGUF as it is (Q4_K_M),
  ``n_threads=2, n_threads_batch=2``, ``n_batch=2048`` with the default ``n_ubatch=512``
  (llama-bench's defaults), other settings left at the high-level API's defaults
  (flash attention off, full-size SWA cache); these are recorded in the JSON.

Prompts: one fixed English paragraph, tokenized once by the GGUF's own tokenizer and
repeated to length; BOS first. Request ``i`` of a batch starts ``i * 101`` tokens further
into the repeated text, so concurrent requests have equal lengths and different contents.
Both peers get the same token ids.

Measurements (full sizes; ``--quick`` uses prefill 64 and 256, contexts 128 and 256,
4 decode steps, 2 concurrent requests, same JSON layout):

* prefill tokens/s at 128, 2048 and 8192 prompt tokens: one timed forward pass over the
  prompt (transformers: ``logits_to_keep=1``, ``use_cache=True``, under ``torch.no_grad()``;
  llama.cpp: ``llm.reset()`` then a timed ``llm.eval(tokens)``, logits of the last position
  only), tokens / wall seconds.
* decode tokens/s: prefill the context untimed, then time greedy steps of one token per
  request (argmax of the last position's logits, included in the time): 32 steps for one
  request at contexts 512 and 8192, reported as 32 / seconds, and for transformers 16
  steps of a batch of 16 requests at context 512, reported as 16 * 16 / seconds. Not run,
  recorded as ``null`` with the reason in ``notes``: 16 requests at context 8192, and
  any batch on llama-cpp-python, whose high-level API serves one sequence.

Before timing, each peer makes an untimed warm-up pass (a 128-token prefill and two decode
steps; transformers also two steps of a batch over a 32-token prompt, so the batched
matmul shapes are warm). Each figure is a single timed run. With 2 threads on a 2-core
machine, any other busy process stalls the threaded kernels badly, so each measurement
records the 1-minute load average before and after it; distrust figures taken under load.

Each (peer, dtype) runs in a fresh subprocess of this script, so its peak RSS
(``ru_maxrss``, loading included) is its own; the parent gathers the children's results
and writes the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plotting import progress

THREADS = 2
LLAMA_N_BATCH = 2048
REQUEST_OFFSET = 101
PEERS = ("transformers:float32", "transformers:bfloat16", "llama_cpp:Q4_K_M")

PARAGRAPH = (
    "The old lighthouse keeper walked along the shore every morning before the sun came up. "
    "He counted the boats in the harbour, checked the ropes on the pier, and wrote the weather "
    "in a small notebook that he kept in his coat pocket. In the afternoon he repaired nets "
    "for the fishermen and talked with the children who came to ask about the ships that had "
    "passed the point in the night. When the wind turned cold he climbed the tower, cleaned "
    "the great lamp, and watched the grey water until the first stars appeared over the hills.\n"
)


@dataclass(frozen=True)
class Sizes:
    prefill: tuple[int, ...]
    short_ctx: int
    long_ctx: int
    steps: int
    batch: int
    batch_steps: int
    warmup: int


FULL = Sizes(
    prefill=(128, 2048, 8192),
    short_ctx=512,
    long_ctx=8192,
    steps=32,
    batch=16,
    batch_steps=16,
    warmup=128,
)
QUICK = Sizes(
    prefill=(64, 256), short_ctx=128, long_ctx=256, steps=4, batch=2, batch_steps=4, warmup=64
)


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _body_tokens(gguf: str, length: int) -> list[int]:
    """The paragraph's token ids (no BOS), repeated to ``length``, and the BOS id first."""
    from llama_cpp import Llama

    vocab = Llama(model_path=gguf, vocab_only=True, verbose=False)
    para = vocab.tokenize(PARAGRAPH.encode(), add_bos=False, special=False)
    reps = length // len(para) + 1
    return [vocab.token_bos()] + (para * reps)[:length]


def _prompt(tokens: list[int], n: int, request: int = 0) -> list[int]:
    """BOS followed by ``n - 1`` body tokens, starting ``request * REQUEST_OFFSET`` in."""
    start = 1 + request * REQUEST_OFFSET
    body = tokens[start : start + n - 1]
    if len(body) != n - 1:
        raise ValueError(f"token pool too short for {n} tokens at request {request}")
    return [tokens[0]] + body


def _decode_keys(sizes: Sizes) -> dict[str, tuple[int, int]]:
    return {
        f"1@{sizes.short_ctx}": (1, sizes.short_ctx),
        f"1@{sizes.long_ctx}": (1, sizes.long_ctx),
        f"{sizes.batch}@{sizes.short_ctx}": (sizes.batch, sizes.short_ctx),
        f"{sizes.batch}@{sizes.long_ctx}": (sizes.batch, sizes.long_ctx),
    }


def _skipped_batch_reason(sizes: Sizes) -> str:
    tokens = FULL.batch * FULL.long_ctx
    why = (
        f"{FULL.batch} requests at context {FULL.long_ctx} need {tokens} prompt tokens of "
        f"prefill, over 10 minutes on {THREADS} CPU threads"
    )
    if sizes == FULL:
        return f"not run: {why}"
    return f"not run, as its full-size counterpart is not: {why}"


def _dense_weights(model: Any, dtype: Any) -> str:
    """Check that every Linear holds a dense ``dtype`` weight, and say so.

    transformers 5 keeps GGUF weights packed for the architectures its GGUF kernels cover
    (and warns about bfloat16 even when it will not); Gemma 3 goes through the legacy loader,
    which dequantizes. Were that to change, these figures would be for another thing.
    """
    kinds = {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}
    dtypes = {p.dtype for p in model.parameters()}
    if kinds != {"Linear"} or dtypes != {dtype}:
        raise RuntimeError(f"weights are not dense {dtype}: modules {kinds}, dtypes {dtypes}")
    n = sum(p.numel() for p in model.parameters())
    return f"dense {dtype} nn.Linear, dequantized at load; {n / 1e6:.1f}M parameters"


def _report(peer: str, what: str, value: float) -> None:
    print(f"{peer:24s} {what:16s} {value:10.2f} tok/s", flush=True)


def _measure(label: str, sizes: Sizes, prefill_seconds: Callable[[int], float],
             decode_seconds: Callable[[int, int, int], float],
             not_run: Callable[[int, int], str | None],
             ) -> tuple[dict[str, float], dict[str, float | None], dict[str, str]]:
    """(prefill tokens/s by prompt length, decode tokens/s by ``batch@context``, why
    a decode shape was not run) from a peer's two timers: ``prefill_seconds(n)``
    and ``decode_seconds(batch, context, steps)``."""
    prefill: dict[str, float] = {}
    for n in progress(sizes.prefill, desc="prefill"):
        prefill[str(n)] = n / prefill_seconds(n)
        _report(label, f"prefill {n}", prefill[str(n)])
    notes: dict[str, str] = {}
    decode: dict[str, float | None] = {}
    for key, (batch, ctx) in progress(_decode_keys(sizes).items(), desc="decode"):
        why = not_run(batch, ctx)
        if why is not None:
            decode[key], notes[key] = None, why
            continue
        steps = sizes.steps if batch == 1 else sizes.batch_steps
        decode[key] = batch * steps / decode_seconds(batch, ctx, steps)
        _report(label, f"decode {key}", decode[key])
    return prefill, decode, notes


def _result(prefill: dict[str, float], decode: dict[str, float | None], notes: dict[str, str],
            load_seconds: float, load_before: float) -> dict[str, Any]:
    """A peer's figures, with its peak RSS and the load average around them."""
    return {"prefill": prefill, "decode": decode, "notes": notes,
            "peak_rss_mib": _peak_rss_mib(), "load_seconds": load_seconds,
            "loadavg_1min": {"start": load_before, "end": os.getloadavg()[0]}}


# --------------------------------------------------------------------------- transformers


def _run_transformers(gguf: str, dtype_name: str, tokens: list[int], sizes: Sizes) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    label = f"transformers:{dtype_name}"
    path = Path(gguf)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    load_seconds = time.perf_counter() - t0
    print(f"{label:24s} load             {load_seconds:10.2f} s", flush=True)
    weights = _dense_weights(model, dtype)

    def ids(batch: int, n: int) -> torch.Tensor:
        return torch.tensor([_prompt(tokens, n, r) for r in range(batch)], dtype=torch.long)

    def decode(batch: int, ctx: int, steps: int) -> float:
        """Seconds for ``steps`` greedy decode steps after an untimed prefill of ``ctx``."""
        with torch.no_grad():
            out = model(input_ids=ids(batch, ctx), use_cache=True, logits_to_keep=1)
            cache = out.cache
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=nxt, cache=cache, use_cache=True)
                cache = out.cache
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t

    load_before = os.getloadavg()[0]
    decode(1, sizes.warmup, 2)
    # The batched decode runs matmuls of a new shape; warm them too, on a short prompt.
    decode(sizes.batch, 32, 2)

    def prefill_seconds(n: int) -> float:
        x = ids(1, n)
        with torch.no_grad():
            t = time.perf_counter()
            model(input_ids=x, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t

    prefill, decode_res, notes = _measure(
        label, sizes, prefill_seconds, decode,
        lambda batch, ctx: _skipped_batch_reason(sizes)
        if batch > 1 and ctx == sizes.long_ctx else None)
    notes["decode"] = (
        "greedy, one token per request per step, manual loop passing the DynamicCache back "
        "(`cache=`, transformers 5's name for past_key_values); "
        f"{sizes.steps} steps for 1 request, {sizes.batch_steps} for a batch"
    )
    notes["weights"] = weights

    return {
        "meta": {
            "version": transformers.__version__,
            "torch": torch.__version__,
            "attn_implementation": model.config._attn_implementation,
        },
        "result": _result(prefill, decode_res, notes, load_seconds, load_before),
    }


# ------------------------------------------------------------------------------ llama.cpp


def _run_llama(gguf: str, tokens: list[int], sizes: Sizes) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    label = "llama_cpp:Q4_K_M"
    # Room for the longest prompt or the longest context plus its decode steps.
    need = max(max(sizes.prefill), sizes.long_ctx + sizes.steps + 2)
    n_ctx = -(-need // 256) * 256

    t0 = time.perf_counter()
    llm = Llama(
        model_path=gguf,
        n_ctx=n_ctx,
        n_batch=LLAMA_N_BATCH,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )
    load_seconds = time.perf_counter() - t0
    print(f"{label:24s} load             {load_seconds:10.2f} s", flush=True)
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # With logits_all=False, Llama.eval no longer copies logits into llm.scores, so read
        # the last position's row from the context directly.
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(row, shape=(n_vocab,)).argmax())

    def decode(ctx: int, steps: int) -> float:
        llm.reset()
        llm.eval(_prompt(tokens, ctx))
        tok = greedy()
        t = time.perf_counter()
        for _ in range(steps):
            llm.eval([tok])
            tok = greedy()
        return time.perf_counter() - t

    load_before = os.getloadavg()[0]
    decode(sizes.warmup, 2)

    def prefill_seconds(n: int) -> float:
        x = _prompt(tokens, n)
        llm.reset()
        t = time.perf_counter()
        llm.eval(x)
        return time.perf_counter() - t

    prefill, decode_res, notes = _measure(
        label, sizes, prefill_seconds, lambda _, ctx, steps: decode(ctx, steps),
        lambda batch, _: None if batch == 1 else (
            "not run: llama-cpp-python's high-level Llama API evaluates one sequence; "
            "concurrent requests would need the low-level batch API or llama-server"))
    notes["decode"] = (
        f"greedy (argmax of llama_get_logits_ith(ctx, -1)), {sizes.steps} single-token "
        "llm.eval([tok]) steps after an untimed llm.eval of the context"
    )
    notes["settings"] = (
        f"n_ctx={llm.n_ctx()}, n_batch={llm.n_batch}, "
        f"n_ubatch={llm.context_params.n_ubatch}, flash_attn=off (high-level API default), "
        f"swa_full={bool(llm.context_params.swa_full)}"
    )

    return {
        "meta": {
            "version": llama_cpp.__version__,
            "n_batch": llm.n_batch,
            "n_ubatch": llm.context_params.n_ubatch,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        },
        "result": _result(prefill, decode_res, notes, load_seconds, load_before),
    }


# --------------------------------------------------------------------------------- driver


def _child(args: argparse.Namespace, sizes: Sizes) -> None:
    tokens = json.loads(Path(args.tokens).read_text())
    peer, dtype = args.one.split(":", 1)
    if peer == "transformers":
        out = _run_transformers(args.gguf, dtype, tokens, sizes)
    elif peer == "llama_cpp":
        out = _run_llama(args.gguf, tokens, sizes)
    else:
        raise ValueError(f"unknown peer {args.one!r}")
    Path(args.json).write_text(json.dumps(out))


def _parent(args: argparse.Namespace, sizes: Sizes) -> int:
    longest = max(max(sizes.prefill), sizes.long_ctx)
    tokens = _body_tokens(args.gguf, longest + sizes.batch * REQUEST_OFFSET)

    report: dict[str, Any] = {
        "machine": {"cpu": _cpu_model(), "threads": THREADS},
        "transformers": {},
        "llama_cpp": {},
    }
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = Path(tmp) / "tokens.json"
        tok_path.write_text(json.dumps(tokens))
        for one in PEERS:
            out_path = Path(tmp) / f"{one.replace(':', '_')}.json"
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                args.gguf,
                "--json",
                str(out_path),
                "--one",
                one,
                "--tokens",
                str(tok_path),
            ]
            if args.quick:
                cmd.append("--quick")
            rc = subprocess.run(cmd, check=False).returncode
            peer, dtype = one.split(":", 1)
            if rc != 0:
                failed.append(one)
                report[peer][dtype] = {"error": f"child process exited with status {rc}"}
                continue
            child = json.loads(out_path.read_text())
            report[peer].update(child["meta"])
            report[peer][dtype] = child["result"]

    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", help="path of the Gemma 3 270M GGUF file")
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.one:
        _child(args, sizes)
        return 0
    return _parent(args, sizes)


if __name__ == "__main__":
    sys.exit(main())
