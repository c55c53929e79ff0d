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

    JAX keeps it in a private module, read by core's ``jax_api.cudnn_version``.
    """
    from attn_backends.authoring import jax_api

    return jax_api.cudnn_version()


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
