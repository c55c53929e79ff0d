"""The tokamax backends: one per tokamax attention implementation that has a platform.

Importing this module imports no tokamax (the manifests are static; ``check``
reads tokamax's version from its distribution metadata): ``attend`` imports
it on first use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import attn_backends
from attn_backends.authoring import (
    QUANTIZED_KV_DTYPES,
    AttentionCall,
    Backend,
    HeadDims,
    Operands,
    distribution_version,
    manifest,
    refuse,
    resolve_options,
)

from . import _jax_lines as jax_lines
from ._environment import tokamax_reasons, tokamax_version
from ._interpret import SWITCH
from ._paged import TokamaxPaged

#: What tokamax's plain-XLA implementations serve through its public API, as the
#: suite certified it: no lse (the public API returns none), no dropout (it
#: takes a keep-mask but the public API passes none), no float64 (its dot
#: algorithm presets stop at float32). Softcap with bias is refused in
#: ``check`` (tokamax caps after adding the bias, the contract before).
XLA_MANIFEST = manifest(
    platforms={"cpu", "gpu", "tpu"},
    features={"gqa", "causal", "window", "segment_ids", "lengths", "mask", "bias", "softcap"},
    bias_grad=True,
    differentiable=True,
    deterministic=True,
    partitionable=False,
    # Traced inside a user's shard_map with check_vma=True on both lines
    # (tests/multidevice/test_multidevice_anywhere.py, the suite's shard_map test).
    check_vma=True,
    jax_versions=">=0.10,<0.13",
    # Quantized K and V as qwix QArrays, which tokamax's XLA implementations
    # dequantize whole before attending (quantization.as_array): forward only.
    kv_dtypes=QUANTIZED_KV_DTYPES,
)

#: The chunk length ``tile_small_options`` gives ``tokamax_xla_chunked``.
SMALL_CHUNK = 16

#: Why a call with both softcap and bias is refused (the README's findings table).
SOFTCAP_WITH_BIAS = (
    "softcap with bias: tokamax caps scale*q.k + bias (c*tanh((s+bias)/c)), the contract "
    "caps scale*q.k and adds the bias after (c*tanh(s/c) + bias)"
)


class TokamaxBackend(Backend):
    """A tokamax implementation behind the contract; subclasses name it.

    Takes no ``options``.
    """

    #: The adapter's version with tokamax's (a local version label), so a
    #: certificate is bound to both: another tokamax is another backend version.
    version = (f"{distribution_version('attn-backend-tokamax')}"
               f"+tokamax.{tokamax_version() or 'missing'}")
    #: The implementation tokamax runs (``implementation=`` of its API).
    implementation: ClassVar[str]

    #: The jax releases this implementation is served on, per tokamax release (none:
    #: the manifest's range).
    jax_lines: ClassVar[tuple[jax_lines.JaxLine, ...]] = ()

    def check(self, call: AttentionCall) -> list[str]:
        reasons = list(tokamax_reasons())
        for line in self.jax_lines:
            reasons += line.reasons()
        if call.softcap is not None and call.bias_shape is not None:
            reasons.append(SOFTCAP_WITH_BIAS)
        return reasons

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        """q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` ->
        out ``[B, Tq, Hq, Dv]``.

        Core has refused whatever the manifest does not claim before this runs;
        what ``check`` declines is refused here too (for code calling ``attend``
        directly).
        """
        refuse(self.name, call, self.check(call))
        from ._adapter import run
        from ._environment import import_tokamax

        import_tokamax()  # before implementation_for imports tokamax's modules

        return run(call, q, k, v, operands, self.implementation_for(call, options),
                   **self.adapter_args)

    #: Keyword arguments of ``_adapter.run`` for this implementation.
    adapter_args: ClassVar[dict[str, Any]] = {}

    def implementation_for(self, call: AttentionCall, options: Any) -> Any:
        """What ``tokamax.dot_product_attention`` gets as ``implementation``: the
        name of :attr:`implementation` (this backend takes no ``options``)."""
        if options is not None:
            raise ValueError(f"options: {self.name} takes none, got {type(options).__name__}")
        return self.implementation


class TokamaxXlaBackend(TokamaxPaged, TokamaxBackend):
    """tokamax's ``xla`` implementation: dense logits in XLA, on any platform;
    paged calls over its pages gathered dense (``_paged``)."""

    name = "tokamax_xla"
    implementation = "xla"
    capabilities = XLA_MANIFEST
    # Below xla_native (50) everywhere: it materialises every logit (memory
    # quadratic in T; BENCHMARKS.md), above reference (0).
    priority = {"cpu": 20, "gpu": 20, "tpu": 20}


@dataclasses.dataclass(frozen=True)
class ChunkSizes:
    """Query and key chunk lengths of ``tokamax_xla_chunked`` (pass as ``options``;
    None: tokamax's own, 512 queries by 1024 keys). Any positive ints: tokamax
    runs the last, shorter chunk of each axis on its own."""

    q: int
    kv: int

    def __post_init__(self) -> None:
        for name in ("q", "kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ChunkSizes: {name}={value!r} must be an int >= 1")


class TokamaxXlaChunkedBackend(TokamaxPaged, TokamaxBackend):
    """tokamax's ``xla_chunked`` implementation: query/key chunks in XLA loops
    (online softmax), 512x1024 by default; paged calls as ``tokamax_xla``'s.

    ``options``: a :class:`ChunkSizes`, or None for tokamax's own.
    """

    name = "tokamax_xla_chunked"
    implementation = "xla_chunked"
    capabilities = XLA_MANIFEST
    priority = {"cpu": 15, "gpu": 15, "tpu": 15}

    def tile_small_options(self, call: AttentionCall) -> Any:
        """16x16 chunks, so the suite's and the probe's few dozen tokens cross the
        chunk loops (the default chunks hold every small call in one remainder
        chunk); None when the call fits in one such chunk."""
        if max(call.q_len, call.kv_len) <= SMALL_CHUNK:
            return None
        return ChunkSizes(SMALL_CHUNK, SMALL_CHUNK)

    def implementation_for(self, call: AttentionCall, options: Any) -> Any:
        """tokamax's own chunks (``"xla_chunked"``), or its implementation object
        for the chunks ``options`` (a :class:`ChunkSizes`) names."""
        chunks = resolve_options(options, ChunkSizes, lambda: None)
        if chunks is None:
            return self.implementation
        from tokamax._src.ops.attention import xla_chunked  # imported by attend

        return xla_chunked.XlaChunkedDotProductAttention(chunk_size=(chunks.q, chunks.kv))


#: tokamax's Mosaic TPU (splash) implementation without the cpu that interpret
#: mode adds: no bias, no lengths, segment ids or masks (tokamax raises
#: NotImplementedError for its q_end, k_end, and for a boolean mask batched or
#: per head: "Only unbatched boolean masks are supported"; the adapter's own
#: window and causal masks are [1, 1, Tq, Tk]), float32 and bfloat16 only.
MOSAIC_TPU_MANIFEST = manifest(
    platforms={"tpu"},
    features={"gqa", "causal", "window", "softcap"},
    dtypes=frozenset({"float32", "bfloat16"}),
    head_dims=HeadDims(),
    differentiable=True,
    deterministic=True,
    partitionable=False,
    interpret=True,
    jax_versions=">=0.10,<0.13",
)


class TokamaxMosaicTpuBackend(TokamaxBackend):
    """tokamax's ``mosaic_tpu`` implementation (its splash kernels); on cpu in
    Pallas TPU interpret mode while the switch is on."""

    name = "tokamax_mosaic_tpu"
    implementation = "mosaic_tpu"
    #: MOSAIC_TPU_MANIFEST, plus cpu while interpret mode is on.
    capabilities = SWITCH.capabilities(MOSAIC_TPU_MANIFEST)  # type: ignore[assignment]
    # Below flash_pallas (100: the same splash kernels, more features, lse) and
    # above xla_native (50) on a TPU (not measured here: no TPU; `attn-backends
    # tune` measures it); interpret mode on cpu is for tests only.
    priority = {"tpu": 60, "cpu": 5}
    hlo_marker = "tpu_custom_call"

    # tokamax's heuristic blocks (128 queries and keys, the TPU lane width) must
    # divide the sequences: the adapter pads Tq and Tk to them.
    adapter_args: ClassVar[dict[str, Any]] = {"native": False, "multiple": 128}
    jax_lines = (jax_lines.MOSAIC_TPU,)

    def implementation_for(self, call: AttentionCall, options: Any) -> Any:
        """The splash kernels: compiled when lowering for tpu, interpreted when
        lowering for cpu (takes no ``options``)."""
        super().implementation_for(call, options)
        from . import _mosaic_tpu

        return _mosaic_tpu.implementation(interpret=call.platform == "cpu")


#: tokamax's Pallas Triton flash attention, read from its code
#: (``pallas_triton.py``, ``pallas_triton_vjp.py``): the forward takes a boolean
#: mask, bias, softcap, q/k start and end (which lengths and window become) and
#: GQA (``i // group`` in its kv index map); any head dim (blocks padded to the
#: next power of two) and any Tq, Tk (the last block masked); the backward
#: (dq, dk, dv and dbias) takes all of them but softcap, which gets tokamax's XLA
#: backward (``_gpu_kernels.py``): what the XLA implementations serve, on gpu.
#: Lowered, not run, here: nothing here has a GPU, and tokamax's kernel cannot
#: run in Pallas' interpreter (README).
# check_vma not claimed: never traced inside a check_vma shard_map here (no GPU).
# No quantized K and V on the GPU kernels: not certified here (no GPU).
TRITON_MANIFEST = dataclasses.replace(XLA_MANIFEST, platforms=frozenset({"gpu"}),
                                      check_vma=False, kv_dtypes=frozenset())


class TokamaxTritonBackend(TokamaxBackend):
    """tokamax's ``triton`` implementation (Pallas Triton flash attention), on gpu:
    tokamax 0.0.12's on jax < 0.12 (:data:`_jax_lines.TRITON`), 0.0.17's on jax 0.12."""

    name = "tokamax_triton"
    implementation = "triton"
    capabilities = TRITON_MANIFEST
    # A fused flash kernel (memory linear in T), so above xla_native (50), whose
    # blockwise XLA loops are not one; below flash_triton (80, JAX's own Triton
    # kernel, on jax < 0.12 only) and cudnn (100). On jax 0.12 it is the fused
    # kernel a gpu gets without JAX's CUDA plugin. Lowered for cuda here (tests),
    # never run: no GPU in CI; the probe judges it against the oracle at its first
    # use on a GPU (a wrong answer is quarantined, loudly), `make test-gpu`
    # certifies it there and `attn-backends tune` measures it.
    priority = {"gpu": 70}
    hlo_marker = "__gpu$xla.gpu.triton"
    jax_lines = (jax_lines.TRITON,)

    def implementation_for(self, call: AttentionCall, options: Any) -> Any:
        """The Triton forward and backward (XLA backward with softcap; no ``options``)."""
        super().implementation_for(call, options)
        from . import _gpu_kernels

        return _gpu_kernels.triton(softcap=call.softcap is not None)


#: tokamax's Mosaic GPU flash attention (sm90 and sm100 kernels), read from its
#: code (``pallas_mosaic_gpu*.py``): mask, bias (and dbias), softcap, k start and
#: end, causal, GQA, forward and backward; bfloat16 and float16 only (at the
#: default precision tokamax maps float32 to TF32 on a GPU, and its kernels
#: raise NotImplementedError for that preset); any head dim (padded to 64).
#: Not deterministic: tokamax's own tests expect the sm100 backward to differ
#: between runs. Not lse, dropout.
MOSAIC_GPU_MANIFEST = dataclasses.replace(
    TRITON_MANIFEST, dtypes=frozenset({"bfloat16", "float16"}), deterministic=False)

#: The command that certifies the GPU backends on a GPU machine.
CERTIFY_ON_GPU = "make test-gpu"


def hopper_reasons() -> list[str]:
    """Why tokamax's Mosaic GPU kernels cannot lower here (empty: they can).

    tokamax picks its sm90 or sm100 kernel, and refuses any other device, by the
    compute capability of JAX's default device (``gpu_utils.is_sm90()``), not by
    the platform lowered for: this asks the same device.
    """
    from attn_backends.authoring import jax_api

    device = jax_api.default_device()
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if capability is not None and 9.0 <= float(capability) < 11.0:
        return []
    here = (f"{device.device_kind} (compute capability {capability})"
            if device.platform == "gpu" else f"a {device.platform} device")
    return [
        "tokamax's Mosaic GPU kernels need a Hopper (sm90) or Blackwell (sm100) GPU as JAX's "
        f"default device (tokamax asks that device, not the platform lowered for); here it is "
        f"{here}: certify on a Hopper (sm90) or Blackwell GPU: {CERTIFY_ON_GPU}"
    ]


class TokamaxMosaicGpuBackend(TokamaxBackend):
    """tokamax's ``mosaic_gpu`` implementation, on a Hopper or Blackwell GPU, jax
    < 0.12 with tokamax 0.0.12 (:data:`_jax_lines.MOSAIC_GPU`; 0.0.17's: not certified)."""

    name = "tokamax_mosaic_gpu"
    implementation = "mosaic_gpu"
    capabilities = MOSAIC_GPU_MANIFEST
    # As tokamax_triton: below xla_native until a GPU run certifies it.
    priority = {"gpu": 45}
    hlo_marker = "mosaic_gpu"
    jax_lines = (jax_lines.MOSAIC_GPU, jax_lines.MOSAIC_GPU_UNCERTIFIED)
    # tokamax pads the keys to its block (64 or 128) without hiding the padded
    # ones unless a mask does (its own test of that case is skipped: "TODO:
    # Support k-sequence non-multiple of block_kv"): the adapter pads Tq and Tk
    # to 128 and hides the padded keys itself.
    adapter_args: ClassVar[dict[str, Any]] = {"multiple": 128}

    def check(self, call: AttentionCall) -> list[str]:
        return super().check(call) + hopper_reasons()

    def implementation_for(self, call: AttentionCall, options: Any) -> Any:
        """The sm90/sm100 kernels, forward and backward (takes no ``options``)."""
        super().implementation_for(call, options)
        from . import _gpu_kernels

        return _gpu_kernels.mosaic_gpu()


class _Plugin:
    """One entry point per backend, named as the backend (the registry's
    ATTN_BACKENDS_ONLY and DISABLE name entry points), each registering one."""

    def __init__(self, backend: type[Backend]) -> None:
        self.backend = backend

    @attn_backends.hookimpl
    def attn_backends_register(self) -> list[Backend]:
        return [self.backend()]


XLA = _Plugin(TokamaxXlaBackend)
XLA_CHUNKED = _Plugin(TokamaxXlaChunkedBackend)
MOSAIC_TPU = _Plugin(TokamaxMosaicTpuBackend)
TRITON = _Plugin(TokamaxTritonBackend)
MOSAIC_GPU = _Plugin(TokamaxMosaicGpuBackend)


def attn_backends_register() -> list[Backend]:
    """Every tokamax backend (for code that wants them all, e.g. a test registry)."""
    return [plugin.backend() for plugin in (XLA, XLA_CHUNKED, MOSAIC_TPU, TRITON, MOSAIC_GPU)]
