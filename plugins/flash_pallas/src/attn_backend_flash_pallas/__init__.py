"""attn-backend-flash-pallas: the Pallas TPU splash-attention kernels behind attn-backends."""

from ._config import SplashBlockSizes
from ._interpret import ENV_VAR, interpret_enabled, interpret_mode
from ._paged import RaggedBlockSizes
from ._plugin import FlashPallasBackend

__all__ = [
    "ENV_VAR",
    "FlashPallasBackend",
    "RaggedBlockSizes",
    "SplashBlockSizes",
    "interpret_enabled",
    "interpret_mode",
]
