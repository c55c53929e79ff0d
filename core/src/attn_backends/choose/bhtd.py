"""``registry.get(layout="BHTD")``: q, k, v and the output as PyTorch lays them
out, ``[B, H, T, D]``, moved to and from the contract's ``[B, T, H, D]``.

Loaded by the first BHTD call: a BTNH attention never needs it.
"""

from __future__ import annotations

from typing import Any

import jax


def swap_heads_and_length(x: Any) -> Any:
    """``[B, T, H, D]`` <-> ``[B, H, T, D]``: an array, tracer or ShapeDtypeStruct
    (whose sharding, if any, is permuted with it)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.eval_shape(lambda y: y.transpose(0, 2, 1, 3), x)
    return x.transpose(0, 2, 1, 3)


def to_contract_layout(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """BHTD q, k, v -> BTNH. A wrong rank is a ValueError in BHTD's terms; what is
    not an array is passed on, for ``bind`` to refuse by name."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if hasattr(x, "shape") and len(x.shape) != 4:
            raise ValueError(
                f"{name}: expected rank 4 [B, H, T, D] (layout='BHTD'), "
                f"got shape {list(x.shape)}"
            )
    q, k, v = (swap_heads_and_length(x) if hasattr(x, "shape") else x for x in (q, k, v))
    return q, k, v
