"""tokamax's GPU implementations (Pallas Triton; Mosaic GPU, its sm90 and sm100
kernels), as the registry runs them. Imported only by ``attend`` (it imports
tokamax).

What changes from how tokamax itself would run them, by subclassing and by
argument, none by editing tokamax:

- ``supported_on`` is the registry's decision (:class:`RegistryDecidesPlatform`):
  tokamax's own asks the default device, so a cuda export from a cpu host
  would be refused.
- Triton's backward: tokamax's Pallas Triton VJP raises
  ``NotImplementedError("`logits_soft_cap` unsupported.")``, so a call with
  softcap gets tokamax's XLA VJP instead (``base.DotProductAttentionVjp``, the
  one tokamax's own Triton tests pair with this forward).

Mosaic GPU still picks its sm90 or sm100 kernel, and refuses anything else, by
the compute capability of JAX's *default device*, inside its forward and
backward (``gpu_utils.is_sm90()``): the backend's ``check`` asks the same
device, so a refusal is a reason in ``explain``, not an error at lowering.
Neither has an interpret mode (the README's findings).
"""

from __future__ import annotations

import functools
from typing import Any

from tokamax._src.ops.attention import (
    base,
    pallas_mosaic_gpu,
    pallas_mosaic_gpu_vjp,
    pallas_triton,
    pallas_triton_vjp,
)

from ._adapter import RegistryDecidesPlatform


def _registry_decides(kind: type, **fields: Any) -> Any:
    """A ``kind`` (a tokamax op class) with the registry's ``supported_on``, built
    from ``fields`` (``config`` None: tokamax's heuristics pick it per call). The
    subclass adds no field, so tokamax's dataclass machinery (``replace``, config
    binding) is kept."""
    return type(kind.__name__, (RegistryDecidesPlatform, kind), {})(config=None, **fields)


@functools.cache
def triton(softcap: bool) -> Any:
    """The implementation object for ``tokamax.dot_product_attention``: the Triton
    forward, with the Triton backward, or with the XLA one when ``softcap``."""
    vjp = (base.DotProductAttentionVjp() if softcap
           else _registry_decides(pallas_triton_vjp.PallasTritonFlashAttentionVjp, vjp=None))
    return _registry_decides(pallas_triton.PallasTritonFlashAttention, vjp=vjp)


@functools.cache
def mosaic_gpu() -> Any:
    """The implementation object for ``tokamax.dot_product_attention``: the Mosaic
    GPU forward and backward."""
    vjp = _registry_decides(pallas_mosaic_gpu_vjp.PallasMosaicGpuFlashAttentionVjp, vjp=None)
    return _registry_decides(pallas_mosaic_gpu.PallasMosaicGpuFlashAttention, vjp=vjp)
