"""Gemma 3's tokenizer from the GGUF's own vocabulary, built with ``tokenizers``.

The GGUF (``tokenizer.ggml.model = llama``) stores SentencePiece pieces, their
scores and types, but no merges. The tokenizer is the byte-fallback BPE that
transformers builds for a Gemma GGUF: merges derived from the vocabulary (every
split of a piece into two pieces, ranked by the merged piece's id, which orders
the pieces as their scores do), spaces as ``▁``, control pieces matched whole
as special tokens and user-defined pieces (``\\n``, whitespace runs, HTML tags)
matched whole. The build takes seconds, so the result is kept beside the
weights' cache, under the file's SHA-256.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Bump when ``build`` changes: the cached tokenizer.json of an older build is not read.
TOKENIZER_VERSION = 1
#: GGUF token types (SentencePiece's numbering).
CONTROL, USER_DEFINED = 3, 4


def vocabulary(fields: Any) -> tuple[list[str], list[int]]:
    """(pieces, types) from a GGUFReader's fields. llama.cpp's converter wrote the
    user-defined whitespace pieces (``▁▁``, ...) with real spaces: spelled back."""
    tokens = fields["tokenizer.ggml.tokens"]
    pieces = [tokens.contents(i) for i in range(len(tokens.data))]
    pieces = ["\u2581" * len(p) if p and not p.strip(" ") else p for p in pieces]
    return pieces, [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]


def build(pieces: list[str], types: list[int]) -> Any:
    """A ``tokenizers.Tokenizer`` over ``pieces`` (ids are positions), adding no BOS; a
    progress bar on stderr counts the pieces whose merges are derived (none when
    stderr is not a terminal)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from tqdm import tqdm

    ids = {p: i for i, p in enumerate(pieces)}
    merges = []  # (rank of the merged piece, left, right)
    for merged, piece in enumerate(tqdm(pieces, desc="building the tokenizer", unit="piece",
                                        disable=None, file=sys.stderr)):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in ids and piece[k:] in ids]
        merges += [(merged, left, right) for left, right in splits]
    # The earlier the merged piece, the earlier the merge; among one piece's
    # splits, the longer left part first (transformers' generate_merges order).
    merges.sort(key=lambda m: (m[0], -len(m[1]), -len(m[2])))
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=[(a, b) for _, a, b in merges],
                                     unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(p, normalized=False, special=True)
                                  for p, t in zip(pieces, types, strict=True) if t == CONTROL])
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False)
                          for p, t in zip(pieces, types, strict=True) if t == USER_DEFINED])
    return tokenizer


def load_tokenizer(file: Path, folder: Path, read: Callable[[Path], Any] | None = None) -> Any:
    """The tokenizer of GGUF ``file``, from ``folder``'s cache or built (then cached)
    from the file's reader (``read``, default :func:`~attn_gemma3.weights.read_gguf`)."""
    from tokenizers import Tokenizer

    cached = folder / "tokenizer.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    from .weights import read_gguf

    tokenizer = build(*vocabulary((read or read_gguf)(file).fields))
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".json", delete=False) as f:
        pass
    tokenizer.save(f.name)
    os.replace(f.name, cached)
    return tokenizer
