"""attn-backend-xla-native: blockwise, memory-efficient attention in plain JAX/XLA."""

from ._config import BlockConfig, PagedConfig
from ._plugin import XlaNativeBackend

__all__ = ["BlockConfig", "PagedConfig", "XlaNativeBackend"]
