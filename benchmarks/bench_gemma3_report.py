"""BENCHMARKS.md's Gemma 3 tables from bench_gemma3.py's JSON (ours) and
bench_gemma3_peers.py's (transformers, llama.cpp), measured in the same run."""

from __future__ import annotations

from typing import Any

#: Bytes of tensor data in the GGUF (Q4_K_M): what llama.cpp reads per decoded token
#: besides its KV cache (its output head is the Q8_0 embedding).
GGUF_TENSOR_BYTES = 246_587_904


def _f(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def prefill_table(ours: dict[str, Any], peers: dict[str, Any]) -> str:
    tf, ll = peers["transformers"], peers["llama_cpp"]["Q4_K_M"]
    rows = ["| prompt tokens | dtype | ours, dense prefill | ours, served (paged, chunks of 512) "
            "| transformers | llama.cpp (Q4_K_M) | ours dense / transformers | "
            "ours dense / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for dtype in ("float32", "bfloat16"):
        for n, dense in ours[dtype]["prefill"]["dense"].items():
            served = ours[dtype]["prefill"]["served"][n]
            peer, llama = tf[dtype]["prefill"].get(n), ll["prefill"].get(n)
            rows.append(f"| {n} | {dtype} | {_f(dense)} | {_f(served)} | {_f(peer)} | "
                        f"{_f(llama)} | {_ratio(dense, peer)} | {_ratio(dense, llama)} |")
    return "\n".join(rows)


def decode_table(ours: dict[str, Any], peers: dict[str, Any]) -> str:
    tf, ll = peers["transformers"], peers["llama_cpp"]["Q4_K_M"]
    rows = ["| requests @ context | dtype | ours tokens/s | attention share of the step | "
            "share of measured bandwidth | transformers | llama.cpp (Q4_K_M) | "
            "ours / transformers | ours / llama.cpp, 1 request |",
            "|---|---|---|---|---|---|---|---|---|"]
    for dtype in ("float32", "bfloat16"):
        d = ours[dtype]["decode"]
        for key, rate in d["tokens_per_s"].items():
            context = key.split("@")[1]
            peer, llama = tf[dtype]["decode"].get(key), ll["decode"].get(f"1@{context}")
            rows.append(f"| {key} | {dtype} | {_f(rate, 1)} | {d['attention_share'][key]:.0%} | "
                        f"{d['bandwidth_share'][key]:.0%} | {_f(peer, 1)} | "
                        f"{_f(ll['decode'].get(key), 1)} | {_ratio(rate, peer)} | "
                        f"{_ratio(rate, llama)} |")
    return "\n".join(rows)


def layer_table(ours: dict[str, Any]) -> str:
    rows = ["| context | dtype | one local layer (window 512), ms | one global layer, ms |",
            "|---|---|---|---|"]
    for dtype in ("float32", "bfloat16"):
        t = ours[dtype]["layer_decode_ms"]
        rows += [f"| {c} | {dtype} | {t['local'][c]:.3f} | {t['global'][c]:.3f} |"
                 for c in t["local"]]
    return "\n".join(rows)


def memory_lines(ours: dict[str, Any], peers: dict[str, Any]) -> str:
    lines = []
    for dtype in ("float32", "bfloat16"):
        o = ours[dtype]
        lines.append(f"- ours, {dtype}: weights {o['weight_mib']:,.0f} MiB; the compiled decode "
                     "step's memory_analysis(): " + "; ".join(
                         f"{k}: {m['arguments']:,.0f} MiB arguments (weights and every layer's "
                         f"cache), {m['temporaries']:,.0f} MiB temporaries"
                         for k, m in o["decode"]["memory_mib"].items()))
        lines.append(f"- transformers, {dtype}: peak RSS "
                     f"{peers['transformers'][dtype]['peak_rss_mib']:,.0f} MiB")
    lines.append(f"- ours, the whole benchmark process (both dtypes): peak RSS "
                 f"{ours['peak_rss_mib']:,.0f} MiB")
    lines.append(f"- llama.cpp: peak RSS {peers['llama_cpp']['Q4_K_M']['peak_rss_mib']:,.0f} MiB")
    return "\n".join(lines)


def bytes_lines(ours: dict[str, Any], peers: dict[str, Any]) -> str:
    ll = peers["llama_cpp"]["Q4_K_M"]["decode"].get("1@512")
    lines = []
    for dtype in ("float32", "bfloat16"):
        o = ours[dtype]
        ours_bytes = o["weight_mib"] * 2**20
        rate = o["decode"]["tokens_per_s"].get("1@512")
        lines.append(
            f"- {dtype}: a batch-1 decode step reads every weight once, {ours_bytes / 1e6:,.0f} "
            f"MB (the output head alone, the 262,144 x 640 embedding, is "
            f"{262144 * 640 * (4 if dtype == 'float32' else 2) / 1e6:,.0f} MB), against "
            f"llama.cpp's {GGUF_TENSOR_BYTES / 1e6:,.0f} MB of 4- to 8-bit tensors: "
            f"{ours_bytes / GGUF_TENSOR_BYTES:.1f}x the bytes; measured "
            f"{_f(rate, 1)} against {_f(ll, 1)} tokens/s ({_ratio(ll, rate)} slower), at "
            f"{o['decode']['bandwidth_share']['1@512']:.0%} of the {o['bandwidth_gb_s']:.1f} GB/s "
            "a jitted sum over the weights reached in the same run")
    return "\n".join(lines)


def report(ours: dict[str, Any], peers: dict[str, Any]) -> str:
    return "\n\n".join([
        f"Machine: {ours['machine']['cpu']}, 2 cores; jax {ours['machine']['jax']}; backends "
        f"{ours['float32']['backends']}; transformers {peers['transformers']['version']} (torch "
        f"{peers['transformers']['torch']}, {peers['transformers']['attn_implementation']}); "
        f"llama-cpp-python {peers['llama_cpp']['version']} (n_batch "
        f"{peers['llama_cpp']['n_batch']}).",
        "Prefill, tokens/s:\n\n" + prefill_table(ours, peers),
        "Decode, tokens/s (aggregate over the requests):\n\n" + decode_table(ours, peers),
        "One layer's paged write-then-attend, one request decoding:\n\n" + layer_table(ours),
        "Batch-1 decode against llama.cpp, in bytes read per token:\n\n"
        + bytes_lines(ours, peers),
        "Memory:\n\n" + memory_lines(ours, peers)])
