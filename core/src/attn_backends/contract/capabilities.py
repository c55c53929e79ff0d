"""The static capability manifest a backend declares, readable without a device, and
the tiny version parsing its jax ranges need (no dependency on `packaging`)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .call import DTYPES, FEATURES, QUANTIZED_KV_DTYPES, WIDE_DTYPES, AttentionCall
from .environment import PLATFORMS, check_platform

#: Every dtype a manifest may claim: :data:`DTYPES` (the default claim) and
#: float64, claimed explicitly by a backend that computes in it (x64 only).
CLAIMABLE_DTYPES = DTYPES | WIDE_DTYPES


@dataclass(frozen=True)
class HeadDims:
    """Which head dims (D and Dv) a backend accepts.

    ``allowed``: an explicit set, or None for any; ``max``: an upper bound or
    None; ``multiple_of``: every dim must be a multiple of it.
    """

    allowed: frozenset[int] | None = None
    max: int | None = None
    multiple_of: int = 1

    def __post_init__(self) -> None:
        if self.allowed is not None:
            object.__setattr__(self, "allowed", frozenset(self.allowed))
        if self.multiple_of < 1:
            raise ValueError(f"HeadDims: {self.multiple_of=} must be >= 1")
        if self.max is not None and self.max < 1:
            raise ValueError(f"HeadDims: {self.max=} must be >= 1 or None")

    def reasons(self, dim: int, what: str) -> list[str]:
        """Why ``dim`` is not accepted (empty when it is)."""
        out = []
        if self.allowed is not None and dim not in self.allowed:
            out.append(f"{what}={dim} not in supported head dims {sorted(self.allowed)}")
        if self.max is not None and dim > self.max:
            out.append(f"{what}={dim} exceeds the maximum head dim {self.max}")
        if dim % self.multiple_of:
            out.append(f"{what}={dim} is not a multiple of {self.multiple_of}")
        return out

    def describe(self) -> str:
        parts = []
        if self.allowed is not None:
            parts.append("{" + ",".join(map(str, sorted(self.allowed))) + "}")
        if self.max is not None:
            parts.append(f"<={self.max}")
        if self.multiple_of > 1:
            parts.append(f"%{self.multiple_of}")
        return " ".join(parts) or "any"


@dataclass(frozen=True)
class Manifest:
    """What every manifest declares, dense (:class:`Capabilities`) and paged
    (:class:`~attn_backends.PagedCapabilities`), with one validation.

    ``platforms`` it runs on; ``dtypes`` of q, k, v it serves; ``head_dims``;
    the features both contracts have (``gqa``, ``softcap``, ``window``);
    ``check_vma``: it runs inside a user's ``jax.shard_map`` with
    ``check_vma=True`` (a call there is refused when not claimed);
    ``jax_versions``: a range like ``">=0.10,<0.13"`` it was tested with;
    ``kv_dtypes``: the quantized K and V it reads (a subset of
    :data:`~attn_backends.authoring.QUANTIZED_KV_DTYPES`; empty: K and V in the
    call's dtype only).
    """

    platforms: frozenset[str]
    dtypes: frozenset[str] = DTYPES
    head_dims: HeadDims = field(default_factory=HeadDims)
    gqa: bool = False
    softcap: bool = False
    window: bool = False
    check_vma: bool = False
    jax_versions: str = ""
    kv_dtypes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        name = type(self).__name__
        object.__setattr__(self, "platforms", frozenset(self.platforms))
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        if isinstance(self.kv_dtypes, str):
            raise ValueError(f"{name}: kv_dtypes must be a collection of dtype names, "
                             f"got the string {self.kv_dtypes!r}")
        object.__setattr__(self, "kv_dtypes", frozenset(self.kv_dtypes))
        if not self.kv_dtypes <= frozenset(QUANTIZED_KV_DTYPES):
            raise ValueError(f"{name}: kv_dtypes={sorted(self.kv_dtypes)} must be a "
                             f"subset of {list(QUANTIZED_KV_DTYPES)}")
        if not self.platforms:
            raise ValueError(
                f"{name}: platforms is empty; name at least one of {sorted(PLATFORMS)} "
                "or a JAX PJRT plugin's platform (e.g. 'neuron')"
            )
        for platform in sorted(self.platforms, key=str):
            check_platform(platform, f"{name}: platforms")
        if not self.dtypes or not self.dtypes <= CLAIMABLE_DTYPES:
            raise ValueError(
                f"{name}: dtypes={sorted(self.dtypes)} must be a non-empty "
                f"subset of {sorted(CLAIMABLE_DTYPES)}"
            )
        validate_spec(self.jax_versions)

    def unmet_by(self, call: Any, platform: str | None, head_dims: tuple[int, ...],
                 extra: Sequence[str] = ()) -> list[str]:
        """Why this manifest excludes ``call`` (dense or paged: its ``dtype``,
        ``features`` and ``kv_dtype``) on ``platform`` (None: whatever the
        platform), with ``head_dims`` (D, then Dv when it differs) and a
        subclass's ``extra`` reasons; in that order, then the features it does
        not claim (:attr:`features`, each subclass's), then quantized K and V it
        does not read. Empty if nothing does."""
        reasons = []
        if platform is not None and platform not in self.platforms:
            reasons.append(f"platform {platform!r} not in {sorted(self.platforms)}")
        if call.dtype not in self.dtypes:
            reasons.append(f"dtype {call.dtype} not in {sorted(self.dtypes)}")
        for what, dim in zip(("head_dim", "v_head_dim"), head_dims, strict=False):
            reasons += self.head_dims.reasons(dim, what)
        reasons += extra
        reasons += [f"feature {f!r} not supported"
                    for f in sorted(call.features - self.features)]  # type: ignore[attr-defined]
        if call.kv_dtype is not None and call.kv_dtype not in self.kv_dtypes:
            reads = ", ".join(sorted(self.kv_dtypes)) or "none"
            reasons.append(f"kv dtype {call.kv_dtype}: reads no such quantized K, V "
                           f"(reads {reads})")
        return reasons

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly view: fields by name, sets as sorted lists, head dims as
        their description."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, HeadDims):
                value = value.describe()
            out[f.name] = value
        return out


@dataclass(frozen=True)
class Capabilities(Manifest):
    """What a backend can serve. The selector and the conformance suite read it.

    Besides :class:`Manifest`'s fields: feature flags (``causal`` ...
    ``return_lse``, ``dropout``, with ``gqa``, ``softcap`` and ``window``) name
    the features of :data:`attn_backends.FEATURES`; ``bias_grad`` and
    ``differentiable`` say whether gradients w.r.t. bias and q/k/v are
    implemented; ``deterministic``, ``partitionable`` (XLA may partition it
    over a mesh) and ``interpret`` (an emulated kernel) describe how it runs.
    """

    causal: bool = False
    segment_ids: bool = False
    lengths: bool = False
    mask: bool = False
    bias: bool = False
    bias_grad: bool = False
    return_lse: bool = False
    dropout: bool = False
    differentiable: bool = False
    deterministic: bool = True
    partitionable: bool = False
    interpret: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bias_grad and not self.bias:
            raise ValueError("Capabilities: bias_grad=True needs bias=True")

    @functools.cached_property
    def features(self) -> frozenset[str]:
        """The call features (of :data:`FEATURES`) this manifest claims."""
        return frozenset(f for f in FEATURES if getattr(self, f))

    def unmet(self, call: AttentionCall, platform: str) -> list[str]:
        """Every reason this manifest excludes ``call`` on ``platform``; empty if none."""
        return self._unmet(call, platform)

    def unclaimed(self, call: AttentionCall) -> list[str]:
        """What ``call`` uses that this manifest does not claim (dtype, head dims,
        features), whatever the platform; empty if none."""
        return self._unmet(call, None)

    def _unmet(self, call: AttentionCall, platform: str | None) -> list[str]:
        dims = (call.head_dim,) if call.v_head_dim == call.head_dim else (
            call.head_dim, call.v_head_dim)
        return self.unmet_by(call, platform, dims)

    def served_call(self, call: AttentionCall) -> AttentionCall:
        """The call core hands a backend with this manifest for ``call``.

        A key mask ``[B|1, 1, 1, Tk]`` (:attr:`AttentionCall.key_mask`) reaches a
        backend claiming ``mask`` as the pairwise mask ``[B|1, 1, Tq, Tk]``, and
        one claiming ``segment_ids`` but not ``mask`` as segment ids (no mask;
        ``attn_backends.choose.dispatch.served_operands`` builds the ids, with the
        same answer). Every other call, and a key mask for a manifest claiming
        neither, is handed over as it is (and refused when unclaimed).
        """
        if not call.key_mask:
            return call
        assert call.mask_shape is not None
        if self.mask:
            return dataclasses.replace(
                call, mask_shape=(call.mask_shape[0], 1, call.q_len, call.kv_len))
        if self.segment_ids:
            return dataclasses.replace(call, mask_shape=None, segment_ids=True)
        return call


_RELEASE = re.compile(r"^\s*(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.10.2rc1"`` -> ``(0, 10, 2)``; trailing zeros dropped so 0.10 == 0.10.0."""
    match = _RELEASE.match(version)
    if not match:
        raise ValueError(f"version={version!r} is not a release number like '0.10.2'")
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def validate_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` is like ``">=0.10,<0.13"``."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        if not _CLAUSE.match(clause):
            raise ValueError(
                f"version range clause {clause!r} in {spec!r} is not of the form "
                "'>=0.10' (operators: >=, <=, ==, !=, >, <)"
            )


@functools.lru_cache(maxsize=256)
def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every comma-separated clause of ``spec``
    (cached: selection asks it of every backend for every new call)."""
    have = release_tuple(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = _CLAUSE.match(clause)
        if not match:
            raise ValueError(f"bad version range {spec!r}")
        op, bound = match.group(1), release_tuple(match.group(2))
        ok = {
            ">=": have >= bound,
            "<=": have <= bound,
            ">": have > bound,
            "<": have < bound,
            "==": have == bound,
            "!=": have != bound,
        }[op]
        if not ok:
            return False
    return True
