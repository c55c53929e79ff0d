"""tokamax's Mosaic TPU implementation (its splash kernels), as the registry runs it.

Two changes to how tokamax itself would run it, both by subclassing, neither by
editing tokamax:

- ``supported_on`` is the registry's decision (:class:`RegistryDecidesPlatform`):
  tokamax's own (``device.platform == "tpu"`` and a v5+ TPU, asked of the
  *default device*) refuses a TPU export from a cpu host and every cpu run, even
  in interpret mode. The backend's manifest already restricts it to tpu (and
  cpu while interpret mode is on).
- interpret mode: tokamax's configs carry no ``interpret`` field, but splash's
  ``SplashConfig`` has one and tokamax copies every config field into it, so
  the configs here add that field (forward and backward kernels alike).

Imported only by ``attend`` (it imports tokamax).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pydantic
from tokamax._src.ops.attention import pallas_mosaic_tpu as fwd
from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as bwd

from ._adapter import RegistryDecidesPlatform


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True)
class _InterpretedConfig(fwd.Config):
    interpret: bool = True


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True)
class _InterpretedVjpConfig(bwd.Config):
    interpret: bool = True


def _interpreted(config: Any, kind: type) -> Any:
    return kind(**dataclasses.asdict(config))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Vjp(RegistryDecidesPlatform, bwd.PallasMosaicTpuFlashAttentionVjp):
    interpret: bool = False

    def _get_heuristics_config(self, ba: Any) -> Any:
        config = super()._get_heuristics_config(ba)
        return _interpreted(config, _InterpretedVjpConfig) if self.interpret else config


@dataclasses.dataclass(frozen=True)
class _Forward(RegistryDecidesPlatform, fwd.PallasMosaicTpuFlashAttention):
    interpret: bool = False

    def _get_heuristics_config(self, ba: Any) -> Any:
        config = super()._get_heuristics_config(ba)
        return _interpreted(config, _InterpretedConfig) if self.interpret else config


@functools.cache
def implementation(interpret: bool) -> Any:
    """The implementation object for ``tokamax.dot_product_attention``; ``interpret``:
    its kernels run in Pallas' TPU interpreter (for a cpu lowering)."""
    return _Forward(config=None, vjp=_Vjp(config=None, vjp=None, interpret=interpret),
                    interpret=interpret)
