"""Example attn-backends backend wrapping ``jax.nn.dot_product_attention``."""

from ._plugin import ExampleDenseBackend

__all__ = ["ExampleDenseBackend"]
