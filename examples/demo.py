"""A tiny transformer block, forward and backward, through the registry on CPU.

Run by `make demo`. Prints the loss, the gradient norm and which backend ran.
"""

from __future__ import annotations

import attn_backends
import jax
import jax.numpy as jnp

B, T, D_MODEL, HQ, HKV = 2, 256, 256, 8, 2
HEAD = D_MODEL // HQ


def init(key: jax.Array) -> dict[str, jax.Array]:
    ks = jax.random.split(key, 6)
    s = D_MODEL**-0.5
    return {
        "wq": jax.random.normal(ks[0], (D_MODEL, HQ * HEAD)) * s,
        "wk": jax.random.normal(ks[1], (D_MODEL, HKV * HEAD)) * s,
        "wv": jax.random.normal(ks[2], (D_MODEL, HKV * HEAD)) * s,
        "wo": jax.random.normal(ks[3], (HQ * HEAD, D_MODEL)) * s,
        "w1": jax.random.normal(ks[4], (D_MODEL, 4 * D_MODEL)) * s,
        "w2": jax.random.normal(ks[5], (4 * D_MODEL, D_MODEL)) * (4 * D_MODEL) ** -0.5,
    }


def block(
    params: dict[str, jax.Array], x: jax.Array, attention: attn_backends.Attention
) -> jax.Array:
    """x ``[B, T, D_MODEL]`` -> ``[B, T, D_MODEL]``: pre-norm GQA attention + MLP."""
    h = jax.nn.standardize(x, axis=-1)
    q = (h @ params["wq"]).reshape(B, T, HQ, HEAD)
    k = (h @ params["wk"]).reshape(B, T, HKV, HEAD)
    v = (h @ params["wv"]).reshape(B, T, HKV, HEAD)
    x = x + attention(q, k, v, causal=True).reshape(B, T, HQ * HEAD) @ params["wo"]
    h = jax.nn.standardize(x, axis=-1)
    return x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]


def main() -> None:
    attention = attn_backends.registry.get(device="cpu")
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, T, D_MODEL))

    def loss(p: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean(block(p, x, attention) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(params)
    grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    q = jax.ShapeDtypeStruct((B, T, HQ, HEAD), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, HKV, HEAD), jnp.float32)
    chosen = attention.explain(q, kv, kv, causal=True).chosen
    hlo = step.lower(params).as_text(debug_info=True)
    in_hlo = f"attn/{chosen}" in hlo
    print(f"\ntransformer block B={B} T={T} d_model={D_MODEL} heads {HQ}:{HKV} (GQA), causal")
    print(
        f"loss {float(value):.6f}  grad norm {float(grad_norm):.6f}  "
        f"finite {bool(jnp.isfinite(grad_norm))}"
    )
    print(f"attention ran on backend: {chosen}; named scope attn/{chosen} in the program: {in_hlo}")


if __name__ == "__main__":
    main()
