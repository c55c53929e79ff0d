"""Errors of each backend on large same-sign logits, and where dv's comes from.

The suite's ``same_sign`` family at a peer's shape (tokamax's
``test_small_sequences``): q, k, v uniform in [1, 2), batch 2, 256 queries,
8 keys, 4 heads, head dim 64 (logits 15 to 20), float32, the output gradient
standard normal. Prints, per backend named and for ``jax.nn.dot_product_attention``
(a dense float32 softmax), the max |error| of out, dq, dk and dv against the
float64 oracle; then splits dv's error of a backward pass that recomputes
P = exp(s - lse) (xla_native's, FlashAttention-2's) in NumPy: P from the
forward's own logits, from logits of the transposed product (as xla_native's
backward forms them), with the row maximum kept apart from lse, and dense
softmax, each summed exactly (float64), so only P's error shows.

    python benchmarks/same_sign_errors.py xla_native reference example_dense
    ATTN_BACKENDS_PALLAS_INTERPRET=1 python benchmarks/same_sign_errors.py flash_pallas
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

SHAPE = {"b": 2, "tq": 256, "tk": 8, "h": 4, "d": 64}


def inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    """q ``[B, Tq, H, D]``, k, v ``[B, Tk, H, D]`` uniform in [1, 2) and the output
    gradient ``[B, Tq, H, D]`` standard normal, float32."""
    b, tq, tk, h, d = SHAPE.values()
    rng = np.random.default_rng(seed)
    q, k, v = (rng.uniform(1, 2, (b, t, h, d)).astype(np.float32) for t in (tq, tk, tk))
    return q, k, v, rng.standard_normal((b, tq, h, d)).astype(np.float32)


def errors(attention: Callable[..., Any], q: np.ndarray, k: np.ndarray, v: np.ndarray,
           d_out: np.ndarray) -> dict[str, float]:
    """Max |error| of out, dq, dk, dv of ``attention(q, k, v)`` against the float64 oracle."""
    import jax
    from attn_backends import oracle

    out, vjp = jax.vjp(jax.jit(attention), q, k, v)
    grads = vjp(d_out)
    want = oracle.attention_vjp(q, k, v, d_out)
    result = {"out": np.abs(np.asarray(out, np.float64) - oracle.attention(q, k, v)[0]).max()}
    for name, got in zip("qkv", grads, strict=True):
        result["d" + name] = np.abs(np.asarray(got, np.float64) - want[name]).max()
    return result


def dv_from_p(q: np.ndarray, k: np.ndarray, d_out: np.ndarray) -> dict[str, float]:
    """dv's max |error| when only P is computed in float32 (summed in float64), by
    how P is formed."""
    import jax.numpy as jnp

    f32, f64 = np.float32, np.float64
    scale = f32(q.shape[-1] ** -0.5)
    s64 = np.einsum("bqhd,bkhd->bhqk", q.astype(f64), k.astype(f64)) * float(scale)
    p64 = np.exp(s64 - s64.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    truth = np.einsum("bhqk,bqhd->bkhd", p64, d_out.astype(f64))
    qs = q * scale
    s = np.asarray(jnp.einsum("bqhd,bkhd->bhqk", qs, k))  # the forward's orientation
    s_t = np.asarray(jnp.einsum("bkhd,bqhd->bhkq", k, qs)).swapaxes(-1, -2)  # transposed
    m = s.max(-1, keepdims=True)
    log_l = np.log(np.exp(s - m).sum(-1, keepdims=True, dtype=f32))
    lse = m + log_l
    ways = {
        "exp(s - lse), s of the forward": np.exp(s - lse),
        "exp(s - lse), s transposed (another matmul)": np.exp(s_t - lse),
        "exp((s - max) - log l), s of the forward": np.exp((s - m) - log_l),
        "exp((s - max) - log l), s transposed": np.exp((s_t - m) - log_l),
        "softmax(s) (dense)": np.exp(s - m) / np.exp(s - m).sum(-1, keepdims=True, dtype=f32),
    }
    return {name: float(np.abs(np.einsum("bhqk,bqhd->bkhd", p.astype(f64), d_out) - truth).max())
            for name, p in ways.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backends", nargs="*", default=["xla_native", "reference"])
    args = parser.parse_args()
    import attn_backends
    import jax

    q, k, v, d_out = inputs()
    print(f"q {list(q.shape)}, k, v {list(k.shape)}, uniform in [1, 2); max |error| vs float64")
    runs: dict[str, Callable[..., Any]] = {"jax.nn (dense)": jax.nn.dot_product_attention}
    for name in args.backends:
        runs[name] = attn_backends.registry.get(device="cpu", backend=name, fallback="error")
    for name, attention in runs.items():
        print(f"{name:16}" + "".join(f" {o}={e:.3g}" for o, e in errors(attention, q, k, v,
                                                                          d_out).items()))
    print("dv's error from P alone (float32 P, float64 sum):")
    for way, err in dv_from_p(q, k, d_out).items():
        print(f"  {way:46} {err:.3g}")


if __name__ == "__main__":
    main()
