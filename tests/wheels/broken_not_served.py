"""In a wheels install of attn-backends[xla] (no reference backend), a third-party
backend that ignores causal is caught by its probe and never served.

Run by tests/wheels/run.sh --variant xla --wheel attn_backend_broken-*.whl.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np

assert "reference" not in ab.registry.backends, "this check is for an install without reference"
assert {"broken", "xla_native"} <= set(ab.registry.backends), sorted(ab.registry.backends)
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(2, 64, 4, 32)), jnp.float32)
k = jnp.asarray(rng.normal(size=(2, 64, 2, 32)), jnp.float32)
attention = ab.registry.get(device="cpu")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = attention(q, k, k, causal=True)
messages = [str(w.message) for w in caught if issubclass(w.category, ab.FallbackWarning)]
assert any("served by 'xla_native', passing over broken: probe" in m for m in messages), messages
want = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(k, 2, axis=2),
                                    is_causal=True)
error = float(jnp.max(jnp.abs(out - want)))
assert error < 1e-5, f"served a wrong causal result: max error {error}"
cli = Path(sys.executable).parent / "attn-backends"  # the installed console script
listing = subprocess.run([str(cli), "probe", "--quarantined"], capture_output=True, text=True)
assert listing.returncode == 1 and "broken 1.0" in listing.stdout, listing.stdout + listing.stderr
print(f"broken backend caught without the reference backend installed (error of the served "
      f"result {error:.1e}); quarantine listed by attn-backends probe --quarantined")
