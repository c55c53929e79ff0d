"""The errors attn_gemma3 raises for bad input: each names what is wrong and what to do."""

from __future__ import annotations


class ModelFileError(ValueError):
    """The GGUF file is missing, corrupted (its SHA-256 differs) or not a Gemma 3 model."""


class PromptError(ValueError):
    """A prompt or a generation length the model cannot serve (empty, longer than the
    context, a negative ``max_new_tokens``)."""
