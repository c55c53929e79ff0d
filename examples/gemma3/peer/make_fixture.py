"""The peer's figures for attn_gemma3's tests: transformers' Gemma3ForCausalLM on the
same GGUF (PyTorch, its own attention), and llama.cpp's tokenizer as a second judge
of token ids. Runs in the peer's own venv (`make gemma3-peer`), never in .venv:

    .venv-peer/bin/python examples/gemma3/peer/make_fixture.py GGUF OUT.json

For every prompt of prompts.json (short ones, one of 512 to 600 tokens so the
sliding window of 512 matters, one of 2,000+): transformers' token ids, its
float32 logits at the last 16 positions (each position's top 16 and the logits of
a fixed sample of 256 ids), and its 32 greedy new tokens with each step's margin
between the best and second-best logit (a near tie can flip under rounding). For
every tokenizer string: transformers' ids, its text decoded back, and llama.cpp's
ids (when llama_cpp imports).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

LAST, TOP, NEW = 16, 16, 32
SAMPLE = np.random.default_rng(0).choice(262144, 256, replace=False).tolist()


def main(gguf: str, out: str) -> None:
    torch.set_num_threads(2)
    here = Path(__file__).parent
    prompts = json.loads((here / "prompts.json").read_text())
    folder, name = str(Path(gguf).parent), Path(gguf).name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    fixture = {"peer": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                       f"attn_implementation={model.config._attn_implementation}, float32",
               "sample_ids": SAMPLE, "prompts": [], "tokenizer": []}
    for kind in ("short", "window", "long"):
        for text in prompts[kind]:
            start = time.perf_counter()
            ids = tok(text, return_tensors="pt").input_ids
            with torch.no_grad():
                logits = model(ids, logits_to_keep=LAST).logits[0].float().numpy()
                gen = model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
            new = gen.sequences[0, ids.shape[1]:].tolist()
            margins = []
            for score in gen.scores:
                top2 = torch.topk(score[0].float(), 2).values
                margins.append(float(top2[0] - top2[1]))
            top = np.argsort(-logits, axis=-1)[:, :TOP]
            fixture["prompts"].append({
                "kind": kind, "text": text, "ids": ids[0].tolist(),
                "top_ids": top.tolist(),
                "top_logits": np.take_along_axis(logits, top, -1).round(5).tolist(),
                "sample_logits": logits[:, SAMPLE].round(5).tolist(),
                "greedy": new, "greedy_margins": [round(m, 5) for m in margins],
                "greedy_text": tok.decode(new, skip_special_tokens=True)})
            print(f"{kind}: {ids.shape[1]} tokens, {time.perf_counter() - start:.1f} s: "
                  f"{fixture['prompts'][-1]['greedy_text']!r}", flush=True)
    llama = _llama_tokenizer(gguf)
    for text in prompts["tokenizer"]:
        ids = tok(text).input_ids
        entry = {"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)}
        if llama is not None:
            # parse_special=True: control text (<start_of_turn>) is that token, as in
            # transformers; llama.cpp prepends BOS like the GGUF says.
            entry["llama_cpp_ids"] = llama.tokenize(text.encode(), add_bos=True, special=True)
        fixture["tokenizer"].append(entry)
    if llama is not None:
        import llama_cpp

        fixture["peer"] += f"; tokenizer also llama-cpp-python {llama_cpp.__version__}"
    Path(out).write_text(json.dumps(fixture, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


def _llama_tokenizer(gguf: str):
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama_cpp not installed: transformers' token ids only")
        return None
    return Llama(model_path=gguf, vocab_only=True, verbose=False)


if __name__ == "__main__":
    main(*sys.argv[1:3])
