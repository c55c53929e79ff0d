"""EasyDeL's ejkernel behind the attn-backends contract: ``ejkernel_xla``, its XLA
flash attention (``kernel_registry.get("flash_attention", "xla", ...)``).

Importing this package does not import ejkernel: the manifest is static and
ejkernel is imported on the first call.
"""

from ._options import EjkernelOptions
from ._plugin import EjkernelXlaBackend

__all__ = ["EjkernelOptions", "EjkernelXlaBackend"]
