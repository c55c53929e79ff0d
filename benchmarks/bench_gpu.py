"""GPU backends against bare cuDNN attention, on the local GPU (issue 18).

Times forward and forward+backward (best of ``--reps`` after one compile) of
q/k/v ``[1, S, H, D]``, causal, for ``cudnn``, the fused Triton kernel
(``flash_triton`` on jax < 0.12, ``tokamax_triton`` from jax 0.12, where JAX
removed flash_triton's kernel) and ``xla_native`` through the registry, and for a peer that calls
``jax.nn.dot_product_attention(implementation="cudnn")`` directly (what a JAX
user on a GPU would write without attn-backends). Prints each time and its
ratio to the peer (> 1: slower than bare cuDNN), with the GPU's name. Refuses
to run without a GPU: no GPU figure is ever made up here.

Usage: .venv/bin/python benchmarks/bench_gpu.py [--seq 1024,4096] [--json]
(``make test-gpu`` runs it.)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import attn_backends
import jax
from attn_backends import Backend, Capabilities, hookimpl
from attn_backends_cli.bench import run

PEER = "bare_cudnn"


class BareCudnn(Backend):
    """jax.nn.dot_product_attention(implementation="cudnn"), nothing added (causal Tq == Tk)."""

    name = PEER
    version = jax.__version__
    capabilities = Capabilities(platforms=frozenset({"gpu"}),
                                dtypes=frozenset({"bfloat16", "float16"}),
                                gqa=True, causal=True, differentiable=True)
    priority = {"gpu": -100}

    def attend(self, call: Any, q: Any, k: Any, v: Any, operands: Any,
               options: Any = None) -> Any:
        return jax.nn.dot_product_attention(q, k, v, scale=call.scale, is_causal=call.causal,
                                            implementation="cudnn")


class _Peer:
    @hookimpl
    def attn_backends_register(self) -> list[Backend]:
        return [BareCudnn()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="1024,4096,16384")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        print("bench_gpu: no GPU visible to JAX; run it on a GPU machine", file=sys.stderr)
        return 2
    registry = attn_backends.Registry(plugins=[_Peer()], probe=None)
    from attn_backends.authoring import jax_api

    triton = "tokamax_triton" if jax_api.pallas_triton_ops_gone() else "flash_triton"
    names = [PEER, "cudnn", triton, "xla_native"]
    rows = run(registry, "gpu", backends=names, seqs=[int(s) for s in args.seq.split(",")],
               heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=True,
               reps=args.reps)
    peer = {(r.seq, r.kind): r.ms for r in rows if r.backend == PEER}
    table = [
        {"backend": r.backend, "seq": r.seq, "pass": r.kind, "ms": round(r.ms, 3),
         "vs_bare_cudnn": (round(r.ms / peer[(r.seq, r.kind)], 2)
                           if (r.seq, r.kind) in peer else None)}
        for r in rows
    ]
    setup = (f"{gpu.device_kind}, jax {jax.__version__}, [1, S, {args.heads}, "
             f"{args.head_dim}] {args.dtype} causal, best of {args.reps}")
    if args.json:
        print(json.dumps({"setup": setup, "rows": table}, indent=2))
        return 0
    print(setup)
    print(f"{'backend':<14}{'S':>7}  {'pass':<8}{'ms':>10}  x bare cuDNN")
    for row in table:
        ratio = "-" if row["vs_bare_cudnn"] is None else f"{row['vs_bare_cudnn']:.2f}"
        print(f"{row['backend']:<14}{row['seq']:>7}  {row['pass']:<8}{row['ms']:>10.3f}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
