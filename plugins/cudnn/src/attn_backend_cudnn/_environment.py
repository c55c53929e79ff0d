"""What this host offers cuDNN attention: the cuDNN library, and the local GPU's generation.

Read at selection time (``check``), never at import or listing.
"""

from __future__ import annotations

#: How reasons tell a user to get cuDNN.
HOW_TO_INSTALL = (
    'install "attn-backend-cudnn[cuda]" (jax[cuda12]: jax-cuda12-plugin and '
    "nvidia-cudnn-cu12, about 900 MB)"
)


def cudnn_version() -> int | None:
    """cuDNN's version as JAX sees it (e.g. 91000 for 9.10.0), or None without it.

    JAX keeps it in a private module (``jax._src.lib.cuda_versions``, present
    with the CUDA plugin installed, None otherwise; same in jax 0.10 and 0.12).
    """
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no cuDNN" here
        return None


def local_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of this host's first GPU, or None without one (e.g. exporting)."""
    import jax

    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return None
    capability = getattr(device, "compute_capability", None)
    if not isinstance(capability, str) or "." not in capability:
        return None
    major, minor = capability.split(".")[:2]
    return int(major), int(minor)
