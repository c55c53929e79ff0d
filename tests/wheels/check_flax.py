"""The flax adapter from the wheels (attn-backends[flax]): flax's own attention and
the adapter on one module and one set of weights, forward, gradients and decoding.

Run by run.sh in the full install's venv. The repo's tests/test_flax.py and
test_flax_nnx.py are the complete checks; this one shows the installed wheel works.
"""

import attn_backends
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from attn_backends_flax import attention_fn

heads, features, t = 4, 32, 9
rng = np.random.default_rng(0)
inputs = jnp.asarray(rng.normal(size=(2, t, features)), jnp.float32)
theirs = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=features)
mine = nn.MultiHeadDotProductAttention(
    num_heads=heads, qkv_features=features,
    attention_fn=attention_fn(attn_backends.registry.get(device="cpu")))
params = theirs.init(jax.random.key(0), inputs)["params"]
mask = nn.make_causal_mask(inputs[..., 0])


def loss(module, params):
    out = module.apply({"params": params}, inputs, mask=mask)
    return jnp.sum(out * out), out


grad = jax.grad(loss, has_aux=True, argnums=1)
(want_grads, want), (got_grads, got) = grad(theirs, params), grad(mine, params)
error = float(jnp.max(jnp.abs(got - want)))
grad_error = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True))
assert error < 2e-6 and grad_error < 1e-4, (error, grad_error)

steps = {}
for name, module in (("theirs", theirs.clone(decode=True)), ("mine", mine.clone(decode=True))):
    cache = module.init(jax.random.key(0), inputs)["cache"]
    outs = []
    for i in range(t):
        out, updated = module.apply({"params": params, "cache": cache}, inputs[:, i:i + 1],
                                    mutable=["cache"])
        cache = updated["cache"]
        outs.append(out)
    steps[name] = jnp.concatenate(outs, axis=1)
decode_error = float(jnp.max(jnp.abs(steps["mine"] - steps["theirs"])))
assert decode_error < 2e-6, decode_error
print(f"flax adapter from the wheels: forward {error:.1e}, gradients {grad_error:.1e}, "
      f"decoding {decode_error:.1e} from flax's own attention")
