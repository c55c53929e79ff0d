"""The issue's calibration point, re-measured: a plain blockwise forward vs dense.

Issue 4 set its 5x floor from "a plain 40-line blockwise forward with causal
block skipping and 512-blocks" measured at 7.6x the dense XLA path. This
script is such a forward (online softmax, 512-blocks, causal blocks above the
diagonal skipped, nothing else), checked against the dense path, and timed
against it and xla_native in the same run, so the floor can be compared with
this machine.

Usage: .venv/bin/python benchmarks/bench_blockwise_baseline.py [--seq 4096]
"""

from __future__ import annotations

import argparse
import os
import time

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np

B, H, D, BLOCK = 1, 8, 64, 512
XLA_NATIVE = attn_backends.Registry(probe=None).get(backend="xla_native")


def plain_blockwise(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention, q/k/v ``[B, S, H, D]`` -> ``[B, S, H, D]``, 512-blocks."""
    seq = q.shape[1]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q * D**-0.5, k, v))
    outs = []
    for i in range(seq // BLOCK):
        qi = q[:, :, i * BLOCK : (i + 1) * BLOCK]

        def body(j, carry, qi=qi, i=i):
            m, denom, acc = carry
            kj = jax.lax.dynamic_slice_in_dim(k, j * BLOCK, BLOCK, axis=2)
            vj = jax.lax.dynamic_slice_in_dim(v, j * BLOCK, BLOCK, axis=2)
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj)
            q_pos = i * BLOCK + jnp.arange(BLOCK)[:, None]
            k_pos = j * BLOCK + jnp.arange(BLOCK)[None, :]
            s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p, c = jnp.exp(s - m_new[..., None]), jnp.exp(m - m_new)
            return (
                m_new,
                denom * c + p.sum(-1),
                acc * c[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vj),
            )

        init = (
            jnp.full((B, H, BLOCK), -jnp.inf),
            jnp.zeros((B, H, BLOCK)),
            jnp.zeros((B, H, BLOCK, D)),
        )
        _, denom, acc = jax.lax.fori_loop(0, i + 1, body, init)  # blocks j <= i only
        outs.append(acc / denom[..., None])
    return jnp.concatenate(outs, axis=2).transpose(0, 2, 1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    q, k, v = (
        jax.random.normal(key, (B, args.seq, H, D))
        for key in jax.random.split(jax.random.key(0), 3)
    )
    plain = jax.jit(plain_blockwise)
    dense = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    )
    ours = jax.jit(lambda q, k, v: XLA_NATIVE(q, k, v, causal=True))
    for fn in (plain, ours):
        np.testing.assert_allclose(fn(q, k, v), dense(q, k, v), atol=2e-4)

    def best(fn, n: int = 3) -> float:
        fn(q, k, v).block_until_ready()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn(q, k, v).block_until_ready()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    # Each contender in a block of back-to-back runs, blocks alternating by round.
    rounds = [(best(plain), best(ours), best(dense)) for _ in range(args.rounds)]
    p, x, d = (min(r[i] for r in rounds) for i in range(3))
    print(f"load average {os.getloadavg()}")
    print(
        f"S={args.seq} causal fwd: plain blockwise {p:.1f} ms, xla_native {x:.1f} ms, "
        f"dense xla {d:.1f} ms; dense/plain {d / p:.2f}x, dense/xla_native {d / x:.2f}x"
    )


if __name__ == "__main__":
    main()
