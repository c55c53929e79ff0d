"""A third-party backend that claims causal and ignores it (a test fixture).

Installed from its wheel next to ``attn-backends[xla]`` alone, it checks
that such a backend is never served silently in an install without the
reference backend: its probe must catch it.
"""

from typing import Any

from attn_backends import Backend, Capabilities, hookimpl


class BrokenBackend(Backend):
    name = "broken"
    version = "1.0"
    capabilities = Capabilities(platforms=frozenset({"cpu"}), gqa=True, causal=True,
                                differentiable=True)
    priority = {"cpu": 1000}

    def attend(self, call: Any, q: Any, k: Any, v: Any, operands: Any, options: Any = None) -> Any:
        """q ``[B, Tq, Hq, D]``, k, v ``[B, Tk, Hkv, D]``: dense attention, causal ignored."""
        import jax

        return jax.nn.dot_product_attention(q, k, v, scale=call.scale)


@hookimpl
def attn_backends_register() -> list[Backend]:
    return [BrokenBackend()]
