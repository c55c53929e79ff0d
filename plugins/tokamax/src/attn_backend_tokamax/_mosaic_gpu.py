"""tokamax's Mosaic GPU implementation (its sm90 and sm100 kernels), as the
registry runs it: ``supported_on`` is the registry's decision
(:class:`RegistryDecidesPlatform`), nothing else changed.

tokamax still picks the sm90 or sm100 kernel, and refuses anything else, by the
compute capability of JAX's *default device*, inside its forward and backward
(``gpu_utils.is_sm90()``): the backend's ``check`` asks the same device, so a
refusal is a reason in ``explain``, not a ``NotImplementedError`` at lowering.
Imported only by ``attend`` (it imports tokamax).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tokamax._src.ops.attention import pallas_mosaic_gpu as fwd
from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp as bwd

from ._adapter import RegistryDecidesPlatform


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Vjp(RegistryDecidesPlatform, bwd.PallasMosaicGpuFlashAttentionVjp):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Forward(RegistryDecidesPlatform, fwd.PallasMosaicGpuFlashAttention):
    pass


@functools.cache
def implementation() -> Any:
    """The implementation object for ``tokamax.dot_product_attention``."""
    return _Forward(config=None, vjp=_Vjp(config=None, vjp=None))
