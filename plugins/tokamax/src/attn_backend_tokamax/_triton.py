"""tokamax's Pallas Triton implementation, as the registry runs it.

Two choices made here, by subclassing and by argument, none by editing tokamax:

- ``supported_on`` is the registry's decision (:class:`RegistryDecidesPlatform`):
  tokamax's own asks the default device for Triton support, so a cuda export
  from a cpu host would be refused.
- the backward: tokamax's Pallas Triton VJP (two Triton kernels) raises
  ``NotImplementedError("`logits_soft_cap` unsupported.")``, so a call with
  softcap gets tokamax's XLA VJP instead (``base.DotProductAttentionVjp``, the
  one tokamax's own Triton tests pair with this forward).

No interpret mode: tokamax passes no ``interpret`` to its ``pallas_call``, and
JAX's own switch (``pallas_tpu_interpret_mode_context_manager`` set to True)
reaches the generic interpreter, which fails on this kernel (the README's
findings). Imported only by ``attend`` (it imports tokamax).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tokamax._src.ops.attention import base
from tokamax._src.ops.attention import pallas_triton as fwd
from tokamax._src.ops.attention import pallas_triton_vjp as bwd

from ._adapter import RegistryDecidesPlatform


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Vjp(RegistryDecidesPlatform, bwd.PallasTritonFlashAttentionVjp):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Forward(RegistryDecidesPlatform, fwd.PallasTritonFlashAttention):
    pass


@functools.cache
def implementation(softcap: bool) -> Any:
    """The implementation object for ``tokamax.dot_product_attention``: the Triton
    forward, with the Triton backward, or with the XLA one when ``softcap``."""
    vjp = base.DotProductAttentionVjp() if softcap else _Vjp(config=None, vjp=None)
    return _Forward(config=None, vjp=vjp)
