"""What a backend imports: the plugin API and the helpers several plugins would
otherwise each write again, in one module.

Public as ``attn_backends.authoring``; not imported by ``import attn_backends``.
The plugin API: :class:`Backend`, its :class:`Capabilities` manifest
(:class:`HeadDims`, the names in :data:`FEATURES`, :data:`DTYPES`,
:data:`CLAIMABLE_DTYPES`, :data:`PLATFORMS`), :data:`hookimpl`, the call it gets
(:class:`AttentionCall`, :class:`Operands`), the paged contract
(:class:`PagedBackend`, :class:`PagedCapabilities`, :class:`PagedCall`,
:class:`PagedBatch`, :class:`KVCache`, :data:`CANONICAL_LAYOUT`,
:data:`PAGED_FEATURES`, :data:`QUANTIZED_KV_DTYPES` and their ranges,
:data:`LARGEST`) and
:class:`UnsupportedError`. Every helper is optional: a backend is a
:class:`Backend` subclass with a :class:`Capabilities` manifest either way.

- :func:`manifest`: a ``Capabilities`` claiming a set of feature names.
- :func:`distribution_version`: a distribution's installed version, with a
  fallback for a source tree that is not installed.
- :func:`resolve_options`: the options ``attend`` runs with, from the user's
  object (checked for its type) or the backend's default.
- :func:`refuse`: raise ``UnsupportedError`` naming the backend, the call and
  the reasons, when there are any.
- :class:`InterpretSwitch`: the on/off switch (an environment variable and a
  context manager) for a kernel that can run emulated on cpu, and the manifest
  that serves cpu only while it is on.
- :mod:`heads_first` and :class:`HeadsFirstPagedBackend`: the ``heads_first``
  paged cache layout (K and V each ``[Hkv, num_pages, page_size, D]``): its
  exact conversions to and from the canonical view, ``init_cache`` and
  ``write``, and the ``PagedBackend`` whose every cache is in it.
- :func:`paged_rows` and :func:`paged_dense`: each query row's sequence and
  position in a paged batch, and the batch gathered into dense per-sequence
  keys and values with each row's visible positions, for a paged backend over
  a dense kernel.
- :func:`quantize` and :func:`dequantize`: the quantized paged cache's rule
  (values and a float32 scale per position and kv head), what ``write``
  stores and what a backend reads back, block by block.
- :func:`vary_like`: values a backend makes from constants (a loop carry's
  start) typed as varying over the manual axes its inputs vary over, so it
  runs inside a user's ``jax.shard_map`` with ``check_vma=True``.
- :mod:`jax_api`: the JAX APIs that moved between the jax lines (sharding
  tests, ``shard_map``, FFI registration and calls, lowering for an absent
  GPU), each branch with the releases it covers: a backend calls these, not
  the moved API, and the next move of JAX is one file's change.
- :func:`dropout_seed`, :func:`dropout_keep_at` and :func:`dropout_keep`: one
  counter-based rule for attention dropout's keep-mask, so a tiled kernel
  draws each tile's bits from the key and the tile's positions (forward and
  backward alike, whatever their blocks) and a dense backend the whole mask.

Core already refuses, before ``attend`` runs, every call its manifest does not
claim (dtype, head dims, features): nothing here re-checks the manifest.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

from .contract import heads_first, jax_api
from .contract.backend import Backend, hookimpl
from .contract.call import DTYPES, FEATURES, QUANTIZED_KV_DTYPES, AttentionCall, Operands
from .contract.capabilities import CLAIMABLE_DTYPES, Capabilities, HeadDims
from .contract.environment import PLATFORMS, env_flag, vary_like
from .contract.errors import UnsupportedError
from .contract.heads_first import HeadsFirstPagedBackend
from .contract.paged import (
    CANONICAL_LAYOUT,
    PAGED_FEATURES,
    KVCache,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
    canonical_write,
)
from .contract.paged_quantize import LARGEST, dequantize, quantize

__all__ = [
    "CANONICAL_LAYOUT",
    "CLAIMABLE_DTYPES",
    "LARGEST",
    "DTYPES",
    "FEATURES",
    "PAGED_FEATURES",
    "PLATFORMS",
    "QUANTIZED_KV_DTYPES",
    "UNKNOWN_VERSION",
    "AttentionCall",
    "Backend",
    "Capabilities",
    "HeadDims",
    "KVCache",
    "Operands",
    "PagedBackend",
    "PagedBatch",
    "PagedCall",
    "PagedCapabilities",
    "UnsupportedError",
    "env_flag",
    "hookimpl",
    "HeadsFirstPagedBackend",
    "InterpretSwitch",
    "PagedDense",
    "SwitchedManifest",
    "canonical_write",
    "dequantize",
    "distribution_version",
    "dropout_keep",
    "dropout_keep_at",
    "dropout_seed",
    "heads_first",
    "jax_api",
    "manifest",
    "paged_dense",
    "paged_rows",
    "quantize",
    "refuse",
    "resolve_options",
    "vary_like",
]

#: The version a backend reports when its distribution is not installed.
UNKNOWN_VERSION = "0+unknown"

T = TypeVar("T")


def manifest(*, platforms: Iterable[str], features: Iterable[str] = (),
             **fields: Any) -> Capabilities:
    """``Capabilities`` claiming exactly ``features``, names of :data:`attn_backends.FEATURES`.

    ``platforms`` and ``features`` are collections of names (not one string);
    ``fields`` are the manifest's other fields (``dtypes``, ``head_dims``,
    ``bias_grad``, ``differentiable``, ``deterministic``, ``partitionable``,
    ``interpret``, ``jax_versions``, ``kv_dtypes``), with ``Capabilities``' defaults.
    Raises ValueError for a name that is not a feature, TypeError for a feature
    given as a keyword (``causal=True``: name it in ``features``).
    """
    for what, names in (("platforms", platforms), ("features", features)):
        if isinstance(names, str):
            raise TypeError(f"manifest: {what} must be a collection of names, got the string "
                            f"{names!r}")
    claimed = frozenset(features)
    unknown = sorted(claimed - set(FEATURES))
    if unknown:
        raise ValueError(f"manifest: {unknown} are not features; features are {list(FEATURES)}")
    as_keywords = sorted(set(fields) & set(FEATURES))
    if as_keywords:
        raise TypeError(f"manifest: name {as_keywords} in features=, not as keywords")
    flags = {f: f in claimed for f in FEATURES}
    return Capabilities(platforms=frozenset(platforms), **flags, **fields)


def distribution_version(distribution: str, fallback: str = UNKNOWN_VERSION) -> str:
    """The installed version of ``distribution`` (e.g. ``"attn-backend-mine"``), or
    ``fallback`` when it is not installed (code run from a source tree)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return fallback


def resolve_options(options: object, expected: type[T], default: Callable[[], T]) -> T:
    """The options ``attend`` runs with: ``options`` when it is an ``expected``,
    ``default()`` when it is None (only then is ``default`` called).

    Anything else raises ValueError ``options: expected PKG.NAME or None, got
    TYPE``, where ``PKG`` is the top-level package of ``expected`` (which
    should re-export it, as users import it from there).
    """
    if options is None:
        return default()
    if not isinstance(options, expected):
        public = f"{expected.__module__.partition('.')[0]}.{expected.__qualname__}"
        raise ValueError(
            f"options: expected {public} or None, got {type(options).__name__}"
        )
    return options


def paged_rows(batch: Any, rows: int) -> tuple[Any, Any, Any]:
    """Per query row of a :class:`~attn_backends.PagedBatch`: the sequence owning
    it, whether one does, and its key position, each int32/bool ``[rows]``.

    Entries of ``cu_q_lens`` past ``num_seqs`` may be anything: they are replaced
    by the largest int, so the search never lands on an uncounted sequence. Row
    j of sequence s sits at position ``kv_lens[s] - q_len_s + j``; an unowned
    row's sequence and position are those of some counted or clipped row, so a
    caller masks them with ``owned``.
    """
    import jax.numpy as jnp

    cu, num = batch.cu_q_lens, batch.num_seqs
    counted = jnp.arange(cu.shape[0]) <= num
    ends = jnp.where(counted, cu, jnp.iinfo(jnp.int32).max)
    t = jnp.arange(rows)
    seq = jnp.clip(jnp.searchsorted(ends, t, side="right") - 1, 0, batch.kv_lens.shape[0] - 1)
    q_len = cu[seq + 1] - cu[seq]
    return seq, t < cu[num], batch.kv_lens[seq] - q_len + (t - cu[seq])


class PagedDense(NamedTuple):
    """A paged call's batch as dense per-sequence keys and values and per-row
    visibility (:func:`paged_dense`); ``L = P * page_size``.

    ``keys``, ``values`` ``[S, L, Hkv, D]`` (the cache's dtype; a quantized
    cache's dequantized to the call's dtype): sequence s's
    position p, zero past ``kv_lens[s]`` and for uncounted sequences; ``seq``
    int32 ``[rows]``: the sequence owning each query row (some in-range sequence
    for an unowned row); ``owned`` bool ``[rows]``; ``visible`` bool ``[rows,
    L]``: the positions each row sees (causal, the call's window; none for an
    unowned row).
    """

    keys: Any
    values: Any
    seq: Any
    owned: Any
    visible: Any


def paged_dense(call: PagedCall, k_pages: Any, v_pages: Any, batch: Any, rows: int,
                scales: Sequence[Any] = ()) -> PagedDense:
    """Gather each sequence's pages of the canonical K and V ``[num_pages,
    page_size, Hkv, D]`` into contiguous keys and values, and each of the
    ``rows`` query rows' visible positions, for a backend that serves paged
    calls over a dense kernel. It copies every sequence's whole table width of
    pages (``S * P * page_size`` positions of K and V) on each call.

    A quantized call passes the cache's ``scales`` (K's and V's ``[num_pages,
    page_size, Hkv]``), and gets the gathered positions dequantized.

    Garbage the contract says never matters cannot reach a result through it:
    table entries are clipped into the pool, and positions past a sequence's
    length or of an uncounted sequence are zeros (a masked NaN would still meet
    its zero weight: 0 * NaN is NaN).
    """
    import jax.numpy as jnp

    seqs, pages = batch.page_table.shape
    length = pages * call.page_size
    # Table entries past a sequence's last page may be garbage: clip them to a
    # real page, whose positions are zeroed and masked below anyway.
    table = jnp.clip(batch.page_table, 0, k_pages.shape[0] - 1)
    pos = jnp.arange(length)
    counted = jnp.arange(seqs) < batch.num_seqs
    filled = ((pos[None, :] < batch.kv_lens[:, None]) & counted[:, None])[:, :, None, None]
    gathered = [x[table].reshape(seqs, length, call.kv_heads, call.head_dim)
                for x in (k_pages, v_pages)]
    if call.quantized:
        # K's and V's scales [num_pages, page_size, Hkv]: only the gathered
        # positions are dequantized, never the pool.
        gathered = [dequantize(x, s[table].reshape(seqs, length, call.kv_heads), call.dtype)
                    for x, s in zip(gathered, scales, strict=True)]
    keys, values = (jnp.where(filled, x, 0) for x in gathered)
    seq, owned, row_pos = paged_rows(batch, rows)
    visible = (pos[None, :] <= row_pos[:, None]) & owned[:, None]
    if call.window is not None:
        visible &= pos[None, :] >= row_pos[:, None] - call.window[0]
    return PagedDense(keys, values, seq, owned, visible)


def refuse(backend: str, call: AttentionCall, reasons: Sequence[str]) -> None:
    """Raise ``UnsupportedError("BACKEND cannot serve CALL: R1; R2")`` when there
    are ``reasons`` (duplicates dropped, order kept); return when there are none.

    For what ``attend`` must refuse beyond its manifest (core refuses what the
    manifest does not claim), e.g. the reasons of the backend's own ``check``.
    """
    if reasons:
        raise UnsupportedError(
            f"{backend} cannot serve {call.describe()}: " + "; ".join(dict.fromkeys(reasons))
        )


def dropout_seed(key: Any) -> Any:
    """The two uint32 words the keep-mask is drawn from, derived from a call's
    ``dropout_key`` (a typed key of any implementation or a raw ``uint32[2]``
    key): ``uint32[2]``. Derive once per call, outside any tile loop."""
    import jax
    import jax.numpy as jnp

    return jax.random.bits(key, (2,), jnp.uint32)


def dropout_keep_at(seed: Any, b: Any, h: Any, i: Any, j: Any, *, rate: float, q_heads: int,
                    q_len: int) -> Any:
    """Whether the weight of key ``j`` for query ``i`` of head ``h`` in batch row ``b``
    is kept: bool, the broadcast shape of the integer index arrays.

    Counter-based, so it depends on the positions alone, never on how a kernel
    cuts them into tiles: Threefry-2x32 of ``seed`` (:func:`dropout_seed`) on the
    counter pair ``((b * Hq + h) * Tq + i, j)`` (uint32, wrapping past 2**32
    rows), kept when its first word is below ``(1 - rate) * 2**32``. ``b`` and
    ``i`` are positions in the whole call (not in a tile); ``h`` a query head;
    ``rate``, ``q_heads`` and ``q_len`` the call's ``dropout_rate``, Hq and Tq.
    """
    import jax.numpy as jnp
    from jax.extend.random import threefry_2x32

    u32 = jnp.uint32
    row = (jnp.asarray(b).astype(u32) * u32(q_heads) + jnp.asarray(h).astype(u32))
    row = row * u32(q_len) + jnp.asarray(i).astype(u32)
    row, col = jnp.broadcast_arrays(row, jnp.asarray(j).astype(u32))
    bits = threefry_2x32((seed[0], seed[1]), jnp.stack([row, col]))[0]
    threshold = min(round((1.0 - rate) * 2.0**32), 2**32 - 1)
    return bits < u32(threshold)


def dropout_keep(call: AttentionCall, key: Any) -> Any:
    """The whole keep-mask of a dropout ``call``: bool ``[B, Hq, Tq, Tk]``, by
    :func:`dropout_keep_at` (for dense backends and ``Backend.dropout_keep``)."""
    import jax.numpy as jnp

    b, h, i, j = (jnp.arange(n, dtype=jnp.int32).reshape([-1 if a == n_axis else 1
                                                           for a in range(4)])
                  for n_axis, n in enumerate((call.batch, call.q_heads, call.q_len,
                                              call.kv_len)))
    return dropout_keep_at(dropout_seed(key), b, h, i, j, rate=call.dropout_rate,
                           q_heads=call.q_heads, q_len=call.q_len)


class _CpuNote:
    """A manifest whose cpu rejection ends with how to turn interpret mode on.

    Subclassed once per switch (``_off_note`` is a class attribute, not a
    field), so ``as_dict`` and ``dataclasses.replace`` see a plain manifest.
    """

    _off_note: ClassVar[str] = ""

    def unmet(self, call: Any, platform: str) -> list[str]:
        reasons = super().unmet(call, platform)  # type: ignore[misc]
        if platform == "cpu" and "cpu" not in self.platforms:  # type: ignore[attr-defined]
            reasons = [f"{r} ({self._off_note})" if r.startswith("platform ") else r
                       for r in reasons]
        return reasons


@dataclasses.dataclass(frozen=True)
class _CpuSwitchedCapabilities(_CpuNote, Capabilities):
    """A dense manifest with the cpu note of :class:`_CpuNote`."""


@dataclasses.dataclass(frozen=True)
class _CpuSwitchedPagedCapabilities(_CpuNote, PagedCapabilities):
    """A paged manifest with the cpu note of :class:`_CpuNote`."""


class SwitchedManifest:
    """A ``capabilities`` class attribute that reads as :attr:`on` while its
    switch is on (the base manifest plus ``cpu``) and as :attr:`off` otherwise
    (the base manifest, whose cpu rejection says how to turn the switch on).

    Read on the class or an instance alike; reading it reads the switch, so a
    malformed environment variable raises ValueError there.
    """

    def __init__(self, switch: InterpretSwitch, off: Capabilities | PagedCapabilities,
                 on: Capabilities | PagedCapabilities) -> None:
        self.switch, self.off, self.on = switch, off, on

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self.on if self.switch.enabled() else self.off


class InterpretSwitch:
    """Whether a kernel runs emulated on cpu (Pallas' ``interpret=True``): off by default.

    On when ``env_var`` is set to 1/true/yes/on (:func:`attn_backends.env_flag`);
    :meth:`mode` overrides the variable inside a ``with`` block (per thread and
    task: a context variable; nesting restores the outer state). The switch is
    meant to be read when a call is selected and traced, not per step.

    ``package`` is the plugin's import name, which exports ``mode`` as
    ``interpret_mode``; ``kernel`` says what runs emulated ("the Pallas TPU
    kernels") and ``mode_name`` names the mode ("Pallas TPU interpret mode"), both
    for :attr:`how_to_enable` and the cpu rejection of :meth:`capabilities`.
    """

    def __init__(self, env_var: str, *, package: str, kernel: str, mode_name: str) -> None:
        self.env_var = env_var
        self.package = package
        #: How error messages and reasons tell a user to turn the switch on.
        self.how_to_enable = (
            f"set {env_var}=1 or wrap the call in {package}.interpret_mode() "
            f"to run {kernel} emulated on cpu (slow; for tests)"
        )
        #: What a cpu rejection adds while the switch is off.
        self.off_note = f"{mode_name} is off: {self.how_to_enable}"
        self._forced: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
            f"{package}_interpret", default=None
        )

    def enabled(self) -> bool:
        """Whether cpu runs the kernel emulated (so the switched manifest serves cpu).

        The innermost :meth:`mode` block decides; outside any, the environment
        variable (ValueError when it is neither on nor off).
        """
        forced = self._forced.get()
        return env_flag(self.env_var) if forced is None else forced

    @contextlib.contextmanager
    def mode(self, enabled: bool = True) -> Iterator[None]:
        """Run the kernel emulated on cpu inside this block (``enabled=False``: forbid it,
        even when the environment variable is set). Nesting restores the outer state."""
        token = self._forced.set(bool(enabled))
        try:
            yield
        finally:
            self._forced.reset(token)

    def capabilities(self, base: Capabilities | PagedCapabilities) -> SwitchedManifest:
        """The ``capabilities`` class attribute of a backend that serves cpu in interpret mode.

        ``base`` is the manifest without cpu (say ``platforms={"tpu"}``); while
        the switch is on the backend claims ``base`` plus cpu, while it is off
        ``base``, rejecting cpu with a reason ending in :attr:`how_to_enable`.
        A paged manifest (:class:`~attn_backends.PagedCapabilities`) works the
        same way, for ``paged_capabilities``.
        """
        if "cpu" in base.platforms:
            raise ValueError(
                f"InterpretSwitch.capabilities: the base manifest lists cpu "
                f"({sorted(base.platforms)}); the switch is what adds it"
            )
        kind = (_CpuSwitchedPagedCapabilities if isinstance(base, PagedCapabilities)
                else _CpuSwitchedCapabilities)
        noted = type("InterpretCapabilities", (kind,),
                     {"_off_note": self.off_note, "__module__": __name__})
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        off = noted(**fields)
        on = noted(**{**fields, "platforms": base.platforms | {"cpu"}})
        return SwitchedManifest(self, off, on)

    def __repr__(self) -> str:
        return f"<InterpretSwitch {self.env_var} of {self.package}>"


def __getattr__(name: str) -> Any:
    if name == "QUANTIZED_CACHE_DTYPES":  # its name before 0.2
        from .contract import call

        return getattr(call, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
