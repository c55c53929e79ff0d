"""Dense, obviously-correct attention backend for attn-backends."""

from ._plugin import ReferenceBackend, attn_backends_register

__all__ = ["ReferenceBackend", "attn_backends_register"]
