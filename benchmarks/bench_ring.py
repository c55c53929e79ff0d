"""Per-device memory and communication of ring attention against one device.

Run from the repo root (compiles only, never runs a kernel):

    .venv/bin/python benchmarks/bench_ring.py                 # S = 32k and 128k
    .venv/bin/python benchmarks/bench_ring.py --sizes 8192 --devices 4
    .venv/bin/python benchmarks/bench_ring.py [--markdown FILE]

B=1, H=8, D=64, float32, causal. Ring: the registry's attention with the
sequence sharded over a mesh axis of --devices virtual cpu devices
(xla_native per block). Single device: the registry's attention (xla_native)
with nothing sharded. For each, the compiled program's ``memory_analysis()``
(per device): arguments + outputs + temporaries - aliased, for the forward and
for forward+backward (``jax.vjp``, cotangent given). Communication is
computed from shapes (see ``comm_rows``), not measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

import jax

B, H, D = 1, 8, 64
MiB = 1 << 20


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32768,131072", help="sequence lengths, comma-separated")
    parser.add_argument("--devices", type=int, default=8, help="ring size (virtual cpu devices)")
    parser.add_argument("--markdown", help="also write the results as markdown to this file")
    return parser.parse_args()


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    parts = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
    }
    parts["peak"] = parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"]
    return parts


def _programs(att: Any) -> dict[str, Any]:
    def fwd(q: Any, k: Any, v: Any, do: Any) -> Any:
        return att(q, k, v, causal=True)

    def fwd_bwd(q: Any, k: Any, v: Any, do: Any) -> Any:
        _, pull = jax.vjp(lambda q, k, v: att(q, k, v, causal=True), q, k, v)
        return pull(do)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def measure(s: int, devices: int) -> list[dict[str, Any]]:
    """Memory of ring (``devices``) and single-device attention at sequence length ``s``."""
    import attn_backends
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    registry = attn_backends.Registry(probe=None)
    mesh = jax.make_mesh((devices,), ("sp",), devices=jax.devices()[:devices])
    ring_sharding = NamedSharding(mesh, P(None, "sp", None, None))
    rows = []
    for label, sharding, att in (
        (f"ring x{devices}", ring_sharding,
         registry.get(backend="xla_native", sequence_axis="sp", mesh=mesh)),
        ("single device", None, registry.get(backend="xla_native")),
    ):
        arg = jax.ShapeDtypeStruct((B, s, H, D), jnp.float32, sharding=sharding)
        for what, fn in _programs(att).items():
            with jax.sharding.set_mesh(mesh):
                compiled = jax.jit(fn).lower(arg, arg, arg, arg).compile()
            rows.append({"S": s, "layout": label, "program": what, **_memory(compiled)})
            print(rows[-1], flush=True)
    return rows


def comm_rows(s: int, p: int) -> dict[str, float]:
    """Bytes one device sends, from shapes (float32, B=1, Hkv=H=8, D=Dv=64).

    block = B * (S/P) * Hkv * D * 4 bytes (one of k or v on one device).
    forward: (P - 1) ring steps of k and v: 2 * block each; zigzag: q, k, v in
    (3 * block) and out back (block + lse B*H*(S/P)*4).
    backward: (P - 1) steps of k, v plus P hops of float32 dk, dv: 2 * block
    each; zigzag transposes: dq, dk, dv back (3 * block), d_out in (block + lse).
    """
    block = B * (s // p) * H * D * 4
    lse = B * H * (s // p) * 4
    step = 2 * block
    fwd = (p - 1) * step + 3 * block + block + lse
    bwd = (p - 1) * step + p * step + 3 * block + block + lse
    return {"block": block, "step": step, "fwd": fwd, "fwd+bwd": fwd + bwd}


def _markdown(rows: list[dict[str, Any]], devices: int, command: str) -> str:
    lines = [
        "# Ring attention: per-device memory and communication",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cpu cores, "
        f"jax {jax.__version__}; {devices} virtual cpu devices "
        "(`jax_num_cpu_devices`). Compile only: `jit(f).lower(...).compile().memory_analysis()` "
        "of the program of one device, nothing runs.",
        "",
        f"Shapes: B={B}, H={H} (q and kv heads), D={D}, float32, causal. Ring: "
        "`registry.get(backend=\"xla_native\", sequence_axis=\"sp\", mesh=mesh)` on inputs "
        "sharded `P(None, \"sp\", None, None)` (zigzag order, xla_native per block). "
        "Single device: `registry.get(backend=\"xla_native\")`, unsharded. "
        "fwd+bwd is `jax.vjp` pulled back with a given cotangent.",
        "",
        "peak = arguments + outputs + temporaries - aliased, in MiB per device.",
        "",
        "| S | program | layout | arguments | outputs | temporaries | peak | ring / single |",
        "|---|---|---|---|---|---|---|---|",
    ]
    single = {(r["S"], r["program"]): r["peak"] for r in rows if r["layout"] == "single device"}
    for r in rows:
        ratio = r["peak"] / single[(r["S"], r["program"])]
        lines.append(
            f"| {r['S']} | {r['program']} | {r['layout']} | {r['arguments'] / MiB:.1f} | "
            f"{r['outputs'] / MiB:.1f} | {r['temporaries'] / MiB:.1f} | {r['peak'] / MiB:.1f} | "
            + (f"1/{1 / ratio:.1f}" if r["layout"] != "single device" else "") + " |"
        )
    lines += [
        "",
        "## Communication (from shapes)",
        "",
        "One device's k (or v) block is `block = B * (S/P) * Hkv * D * 4` bytes. A ring step "
        "sends k and v: `step = 2 * block`. Forward: `(P-1) * step` around the ring, plus the "
        "zigzag reorder of q, k, v in and of out (and lse, `B*H*(S/P)*4`) back: "
        "`(P-1)*step + 4*block + lse`. Backward adds `(P-1) * step` (k, v again) and "
        "`P * step` (float32 dk, dv travelling home), and the transposed reorders "
        "(`4*block + lse`). Bytes sent per device:",
        "",
        "| S | P | block (MiB) | per ring step (MiB) | fwd total (MiB) | fwd+bwd total (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for s in sorted({r["S"] for r in rows}):
        c = comm_rows(s, devices)
        lines.append(
            f"| {s} | {devices} | {c['block'] / MiB:.1f} | {c['step'] / MiB:.1f} | "
            f"{c['fwd'] / MiB:.1f} | {c['fwd+bwd'] / MiB:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = _parse()
    jax.config.update("jax_num_cpu_devices", args.devices)
    rows = []
    for s in (int(x) for x in args.sizes.split(",")):
        rows += measure(s, args.devices)
    command = "python " + " ".join(["benchmarks/bench_ring.py", *sys.argv[1:]])
    text = _markdown(rows, args.devices, command)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
