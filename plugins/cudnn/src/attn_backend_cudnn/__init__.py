"""attn-backend-cudnn: cuDNN fused attention (jax.nn.dot_product_attention) behind attn-backends."""

from ._environment import cudnn_version, local_compute_capability
from ._plugin import CudnnBackend

__all__ = ["CudnnBackend", "cudnn_version", "local_compute_capability"]
