"""Gemma 3 270M from its GGUF, in JAX, with every attention call through attn-backends.

    import attn_gemma3
    model = attn_gemma3.load(dtype="float32")      # the PyPI package's GGUF
    ids = model.tokenize("The capital of France is")
    logits = model.logits(ids, last=16)            # [16, vocab] float32
    texts = model.generate(["Once upon a time"], max_new_tokens=32)
"""

from .api import Gemma3, load
from .errors import ModelFileError, PromptError
from .serving import Engine, Request
from .weights import Config

__all__ = ["Config", "Engine", "Gemma3", "ModelFileError", "PromptError", "Request", "load"]
