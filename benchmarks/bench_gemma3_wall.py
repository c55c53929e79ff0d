"""Gemma 3 270M where its users sit: the public API's wall clock, ours against
transformers' ``generate`` and llama.cpp's ``create_completion`` (issue 58).

One runtime and dtype per process (ours in .venv, the peers in .venv-peer):

    .venv/bin/python benchmarks/bench_gemma3_wall.py --runtime ours --dtype float32 --json A.json
    .venv-peer/bin/python benchmarks/bench_gemma3_wall.py --runtime transformers \\
        --dtype float32 --gguf MODEL.gguf --json B.json
    .venv-peer/bin/python benchmarks/bench_gemma3_wall.py --runtime llama_cpp \\
        --gguf MODEL.gguf --json C.json
    python3 benchmarks/bench_gemma3_wall.py --report A.json B.json C.json

``make bench-gemma3-wall`` runs all five (ours and transformers in float32 and
bfloat16, llama.cpp on the GGUF as it is, Q4_K_M) one after the other and prints
the report. Each runtime runs on 2 threads (torch.set_num_threads, n_threads;
XLA's CPU client uses the machine's 2 cores).

Cases, greedy, each call made once untimed (so compilation, caches and allocator
pools are warm, as for a user's second call of that shape), then timed
(``--repeat`` times, the median kept):

* ``short``: one prompt (the issue's: "Once upon a time, in a small village by
  the sea, there lived"), 64 new tokens: new tokens / wall seconds of the call;
* ``long``: one prompt of 8,192 tokens (a paragraph repeated), 32 new tokens;
* ``batch16``: 16 prompts of about 128 tokens in one call, 32 new tokens each:
  all new tokens / wall seconds (llama-cpp-python's API serves one sequence: not run);
* ``ttft128`` and ``ttft2048``: the wall seconds of a call for one new token after
  a prompt of 128 and 2,048 tokens: the time to first token.

llama-cpp-python's ``Llama`` keeps the tokens it evaluated last and skips the
matching prefix of the next prompt; each call is preceded by ``llm.reset()``, so
the timed call, like a new request, evaluates its whole prompt.

Prompt lengths are counted by each runtime's own tokenizer of the same GGUF;
each result records its counts. A call may stop early at EOS: each result
records the new tokens it produced, and the rate divides by those.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_gemma3_peers import PARAGRAPH, THREADS, _cpu_model  # noqa: E402
from plotting import axes, note, progress, save, stamp  # noqa: E402

SHORT = "Once upon a time, in a small village by the sea, there lived"
CASES = {"short": (1, None, 64), "long": (1, 8192, 32), "batch16": (16, 128, 32),
         "ttft128": (1, 128, 1), "ttft2048": (1, 2048, 1)}
QUICK = {"short": (1, None, 8), "long": (1, 512, 4), "batch16": (4, 64, 4),
         "ttft128": (1, 64, 1), "ttft2048": (1, 256, 1)}


def prompt_of(length: int, count: Callable[[str], int], offset: int = 0) -> str:
    """The paragraph's words from word ``offset`` on, cycled, cut to the longest text
    of at most ``length`` tokens (BOS included) by ``count``."""
    words = PARAGRAPH.split()
    pool = [words[(offset + i) % len(words)] for i in range(length * 2)]
    low, high = 1, len(pool)
    while low < high:  # the most words whose text is at most `length` tokens
        mid = (low + high + 1) // 2
        if count(" ".join(pool[:mid])) <= length:
            low = mid
        else:
            high = mid - 1
    return " ".join(pool[:low])


class Ours:
    def __init__(self, dtype: str, gguf: str | None):
        import attn_gemma3

        self.model = attn_gemma3.load(gguf, dtype, sha256="package" if gguf is None else None)

    def count(self, text: str) -> int:
        return len(self.model.tokenize(text))

    def generate(self, prompts: list[str], new: int) -> int:
        self.model.generate(prompts, max_new_tokens=new)
        return sum(t.tokens for t in self.model.last_engine.timings.values())


class Transformers:
    def __init__(self, dtype: str, gguf: str | None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(THREADS)
        path = Path(gguf)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()

    def count(self, text: str) -> int:
        return len(self.tok(text)["input_ids"])

    def generate(self, prompts: list[str], new: int) -> int:
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        with self.torch.no_grad():
            out = self.model.generate(**enc, max_new_tokens=new, do_sample=False)
        fresh = out[:, enc["input_ids"].shape[1]:]
        eos = self.tok.eos_token_id
        return sum(int((row != eos).sum()) + int((row == eos).any()) for row in fresh)


class LlamaCpp:
    def __init__(self, dtype: str, gguf: str | None):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_ctx=8192 + 256, n_threads=THREADS,
                         n_threads_batch=THREADS, n_batch=2048, verbose=False)

    def count(self, text: str) -> int:
        return len(self.llm.tokenize(text.encode(), add_bos=True))

    def generate(self, prompts: list[str], new: int) -> int:
        if len(prompts) != 1:
            raise NotImplementedError("llama-cpp-python's create_completion serves one prompt")
        # It would reuse the previous call's evaluated prefix, here the same prompt
        # (the warm call's): a new request has none, so each call starts afresh.
        self.llm.reset()
        out = self.llm.create_completion(prompts[0], max_tokens=new, temperature=0.0)
        return int(out["usage"]["completion_tokens"])


RUNTIMES = {"ours": Ours, "transformers": Transformers, "llama_cpp": LlamaCpp}


def run(runtime: str, dtype: str, gguf: str | None, quick: bool, repeat: int) -> dict[str, Any]:
    start = time.perf_counter()
    peer = RUNTIMES[runtime](dtype, gguf)
    out: dict[str, Any] = {"runtime": runtime, "dtype": dtype if runtime != "llama_cpp"
                           else "Q4_K_M (the GGUF as it is)", "cpu": _cpu_model(),
                           "threads": THREADS, "load_seconds": time.perf_counter() - start,
                           "run": stamp(), "cases": {}}
    cases = QUICK if quick else CASES
    for name, (batch, length, new) in progress(cases.items(), len(cases), f"{runtime} {dtype}"):
        if length is None:
            prompts = [SHORT]
        else:
            prompts = [prompt_of(length, peer.count, offset=17 * i) for i in range(batch)]
        case: dict[str, Any] = {"prompts": batch, "prompt_tokens": [peer.count(p) for p in prompts],
                                "max_new_tokens": new}
        try:
            peer.generate(prompts, new)  # warm: the same shapes, untimed
            times, produced = [], 0
            for _ in range(repeat):
                began = time.perf_counter()
                produced = peer.generate(prompts, new)
                times.append(time.perf_counter() - began)
        except NotImplementedError as exc:
            case["not_run"] = str(exc)
        else:
            seconds = statistics.median(times)
            case.update(seconds=seconds, new_tokens=produced, tokens_per_s=produced / seconds,
                        runs=times, load_average=os.getloadavg()[0])
        out["cases"][name] = case
        note(f"{runtime} {dtype} {name}: {case.get('seconds', 'not run')}")
    return out


def report(paths: Sequence[str]) -> str:
    """A Markdown table: a row per case, a column per runtime and dtype."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    heads = [f"{r['runtime']} {r['dtype'].split(' ')[0]}" for r in results]
    lines = ["| case | " + " | ".join(heads) + " |", "|---|" + "---|" * len(results)]
    for name in CASES:
        cells = []
        for r in results:
            c = r["cases"].get(name, {})
            if "seconds" not in c:
                cells.append("not run")
            elif name.startswith("ttft"):
                cells.append(f"{c['seconds']:.2f} s")
            else:
                cells.append(f"{c['tokens_per_s']:.1f} tok/s ({c['new_tokens']} in "
                             f"{c['seconds']:.2f} s)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _title(name: str, case: dict[str, Any]) -> str:
    """A case's title from what its run recorded (a --quick run's sizes too)."""
    prompts, new = case["prompts"], case["max_new_tokens"]
    tokens = max(case["prompt_tokens"])
    if name.startswith("ttft"):
        return f"{name}: 1 new token after {tokens:,}"
    what = f"{prompts} prompts" if prompts > 1 else "1 prompt"
    return f"{name}: {what} of {tokens:,} tokens, {new} new" + (" each" if prompts > 1 else "")


def plot(paths: Sequence[str], folder: str) -> None:
    """Two figures of the report's run in ``folder``: tokens/s of the generating
    cases, and the time to first token, each runtime and dtype a bar."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    heads = [f"{r['runtime']} {r['dtype'].split(' ')[0]}" for r in results]
    run = results[0].get("run") or {"machine": results[0]["cpu"], "date": "date not recorded"}
    llama = next((r["cases"].get("short", {}).get("tokens_per_s") for r in results
                  if r["runtime"] == "llama_cpp"), None)
    figures = (("gemma3_tokens_per_s.png", ("short", "batch16", "long"), "tokens_per_s",
                "new tokens per second (higher is better)"),
               ("gemma3_ttft.png", ("ttft128", "ttft2048"), "seconds",
                "seconds to the first token (lower is better)"))
    for filename, names, key, label in figures:
        fig, panels = axes(len(names), "Gemma 3 270M through the public API, warm calls "
                           "(median of each runtime's timed calls)", run, width=4.6)
        for ax, name in zip(panels, names, strict=True):
            values = [r["cases"].get(name, {}).get(key) for r in results]
            shown = [(h, v) for h, v in zip(heads, values, strict=True) if v is not None]
            bars = ax.bar(range(len(shown)), [v for _, v in shown],
                          color=[_colour(h) for h, _ in shown])
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set_xticks(range(len(shown)), [h for h, _ in shown], rotation=30, ha="right",
                          fontsize=8)
            ax.set_title(_title(name, results[0]["cases"][name]), fontsize=9)
            ax.set_ylabel(label, fontsize=8)
            if name == "batch16" and llama:  # issue 58's aim, llama.cpp serves one sequence
                ax.axhline(2 * llama, color="#2ca02c", linestyle="--", linewidth=1,
                           label=f"2x llama.cpp's one-request rate ({2 * llama:.0f})")
                ax.set_ylim(top=1.25 * max(v for _, v in shown))  # room for the legend
                ax.legend(fontsize=7, loc="upper left")
        save(fig, Path(folder) / filename)


def _colour(head: str) -> str:
    """ours blue, transformers orange, llama.cpp green; bfloat16 lighter."""
    base = {"ours": "#1f77b4", "transformers": "#ff7f0e", "llama_cpp": "#2ca02c"}
    light = {"ours": "#7fb3de", "transformers": "#ffbb78"}
    runtime, dtype = head.split(" ", 1)
    return light[runtime] if dtype == "bfloat16" and runtime in light else base[runtime]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=sorted(RUNTIMES))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--gguf", default=None, help="the GGUF (ours: default the package's)")
    parser.add_argument("--quick", action="store_true", help="small sizes, to try the script")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON")
    parser.add_argument("--plot", default=None, metavar="FOLDER",
                        help="with --report: also draw its figures as PNGs into FOLDER")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        if args.plot:
            plot(args.report, args.plot)
        return
    result = run(args.runtime, args.dtype, args.gguf, args.quick, args.repeat)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
