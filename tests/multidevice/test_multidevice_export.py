"""A sharded flash_pallas call exports for TPU with its kernel inside the shard_map."""

from __future__ import annotations

import re

import attn_backends as ab
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _functions(text: str) -> dict[str, str]:
    """MLIR text of each ``func.func`` by name (bodies run to the next function)."""
    heads = list(re.finditer(r'func\.func \w+ @"?([^"(]+)"?\(', text))
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return {m.group(1): text[m.start():end] for m, end in zip(heads, ends, strict=True)}


def _reaches(name: str, functions: dict[str, str], marker: str, seen: set[str]) -> bool:
    if name in seen or name not in functions:
        return False
    seen.add(name)
    body = functions[name]
    callees = re.findall(r'call @"?([^"(]+)"?\(', body)
    return marker in body or any(_reaches(c, functions, marker, seen) for c in callees)


def test_export_for_tpu_keeps_the_pallas_kernel_inside_shard_map():
    mesh = AbstractMesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    sharding = NamedSharding(mesh, P("dp", None, "tp", None))
    att = ab.Registry(probe=None).get(device="tpu", backend="flash_pallas")
    arg = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16, sharding=sharding)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(lambda q, k, v: att(q, k, v, causal=True)), platforms=["tpu"]
        )(arg, arg, arg)
    text = exported.mlir_module()
    assert exported.nr_devices == 8
    start = text.index("sdy.manual_computation")
    region = text[start:text.index("sdy.return", start)]
    # The per-device body sees the local shapes: 1 example, 8 / 4 = 2 heads.
    assert "tensor<1x512x2x128xbf16>" in region
    functions = _functions(text)
    callees = re.findall(r'call @"?([^"(]+)"?\(', region)
    assert "tpu_custom_call" in region or any(
        _reaches(c, functions, "tpu_custom_call", set()) for c in callees
    ), callees
    # One kernel in the whole module: it runs only there, on the local shards.
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
