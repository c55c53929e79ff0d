"""Paged attention: selection at ``registry.get_paged`` and the :class:`PagedAttention`
callable (docs/DESIGN.md, "Paged attention").

The backend is chosen once, when the attention is got, not per call: the cache is
made in the chosen backend's layout, so every later call must reach that backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..contract.backend import Backend
from ..contract.capabilities import in_range
from ..contract.environment import varying_axes
from ..contract.errors import (
    AgreementError,
    FallbackWarning,
    NoBackendError,
    PlatformUnavailableError,
    UnsupportedError,
    warn,
)
from ..contract.paged import KVCache, PagedBackend, PagedBatch, PagedCall
from ..contract.paged_bind import check_attend, check_batch_values, check_cache, check_write
from .dispatch import on_platforms, unavailable_message
from .select import Explanation, Verdict, rank

#: ``probe(backend, call, platform, options) -> reasons`` for paged calls (None:
#: nothing compared). The registry passes its probe's ``paged`` (core's prober:
#: :meth:`attn_backends.probe.prober.Prober.paged`).
PagedProbe = Callable[[Backend, PagedCall, str, Any], "list[str] | None"]

NOT_PAGED = "no paged support (the backend does not implement attn_backends.PagedBackend)"


def _paged_reasons(backend: Backend, call: PagedCall, platform: str,
                   jax_version: str) -> list[str]:
    if not isinstance(backend, PagedBackend):
        return [NOT_PAGED]
    reasons = backend.paged_capabilities.unmet(call, platform)
    # The paged manifest's own range, else the backend's.
    spec = backend.paged_capabilities.jax_versions or backend.capabilities.jax_versions
    if spec and not in_range(jax_version, spec):
        reasons.append(f"jax {jax_version} is outside the supported range {spec}")
    if reasons:
        return reasons
    try:
        return [str(r) for r in backend.check_paged(call)]
    except Exception as exc:  # noqa: BLE001 - a broken check is a reason, not a crash
        return [f"check_paged() raised {type(exc).__name__}: {exc}"]


def select_paged(call: PagedCall, platform: str, backends: Sequence[Backend], *,
                 jax_version: str, present: bool = True, prefer: Sequence[str] = (),
                 distributions: Mapping[str, str] | None = None,
                 probe: PagedProbe | None = None,
                 options: Mapping[str, Any] | None = None,
                 probe_also: Collection[str] = ()) -> Explanation:
    """Judge every backend for the paged ``call`` on ``platform``; choose the first survivor.

    As :func:`~attn_backends.select` for dense calls: paged manifest, jax range,
    ``check_paged``, then ``probe`` (when given and the platform is present,
    until one is chosen, and those named in ``probe_also``). A backend without
    paged support is not "passed over" (``platform_ok`` False), so it never
    causes a fallback warning.
    """
    verdicts = []
    chosen = None
    for backend in rank(backends, platform, prefer):
        reasons = _paged_reasons(backend, call, platform, jax_version)
        probed = None
        can_probe = not reasons and probe is not None and present
        deferred = can_probe and chosen is not None and backend.name not in probe_also
        if can_probe and not deferred:
            outcome = probe(backend, call, platform, (options or {}).get(backend.name))
            probed = outcome is not None
            reasons += list(outcome or ())
        accepted = not reasons
        if accepted and chosen is None:
            chosen = backend.name
        paged = isinstance(backend, PagedBackend)
        verdicts.append(Verdict(
            backend=backend.name, version=backend.version,
            distribution=(distributions or {}).get(backend.name),
            priority=backend.priority_on(platform), accepted=accepted,
            reasons=tuple(reasons), probed=probed,
            platform_ok=paged and platform in backend.paged_capabilities.platforms,
            deferred=deferred))
    return Explanation(call, platform, present, tuple(verdicts), chosen)


def choose_paged(explanation: Explanation, *, pinned: str | None, fallback: str) -> str:
    """The chosen backend's name under the fallback policy, or the error saying why none."""
    call, platform = explanation.call, explanation.platform
    if explanation.disagreed:
        raise AgreementError(explanation.agreement)
    if explanation.chosen is None:
        reasons = {v.backend: list(v.reasons) for v in explanation.verdicts}
        if pinned is not None:
            raise UnsupportedError(f"backend={pinned!r} cannot serve {call.describe()} on "
                                   f"{platform}: " + "; ".join(reasons.get(pinned, [])))
        raise NoBackendError(f"no backend can serve {call.describe()} on {platform}:", reasons)
    passed = explanation.passed_over
    if passed and fallback != "silent":
        detail = "; ".join(f"{v.backend}: {', '.join(v.reasons)}" for v in passed)
        message = (f"paged attention {call.describe()} on {platform} is served by "
                   f"{explanation.chosen!r}, passing over {detail}")
        if fallback == "error":
            raise UnsupportedError(message + " (fallback='error')")
        warn(message, FallbackWarning)
    return explanation.chosen


def _no_gradient(name: str) -> Callable[..., Any]:
    """Identity on (q, the cache's arrays) whose derivative, forward or reverse,
    raises: the paged contract has no gradients, and a silent zero would train
    on nothing."""

    @jax.custom_jvp
    def guard(q: Any, arrays: Any) -> Any:
        return q, arrays

    @guard.defjvp
    def _refuse(primals: Any, tangents: Any) -> Any:
        raise UnsupportedError(
            f"paged attention ({name}) has no gradients: it serves inference over a KV "
            "cache. Differentiate the dense attention (registry.get) instead")

    return guard


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array when its value is known here (not traced), else None."""
    if isinstance(x, jax.core.Tracer) or isinstance(x, jax.ShapeDtypeStruct):
        return None
    return np.asarray(x)


def _flag_long_sequences(out: Any, batch: PagedBatch, max_q_len: int) -> Any:
    """NaN in the rows of every sequence with more than ``max_q_len`` rows: under
    ``jit`` the batch is traced, so a broken promise is made loud, never silent."""
    rows = jnp.arange(out.shape[0])
    cu = batch.cu_q_lens
    s = batch.kv_lens.shape[0]
    counted = jnp.arange(s + 1) <= batch.num_seqs
    ends = jnp.where(counted, cu, jnp.iinfo(jnp.int32).max)
    seq = jnp.clip(jnp.searchsorted(ends, rows, side="right") - 1, 0, max(s - 1, 0))
    long = (cu[seq + 1] - cu[seq] > max_q_len) & (rows < cu[batch.num_seqs])
    return jnp.where(long[:, None, None], jnp.nan, out)


class PagedAttention:
    """Paged attention bound to one backend, chosen at ``registry.get_paged``.

    ``init_cache(num_pages)``, ``write(cache, k, v, slots)`` and
    ``__call__(q, cache, batch)``: see docs/DESIGN.md, "Paged attention".
    ``explanation`` holds every backend's verdict from selection. ``local``: got
    inside ``attn_backends.local_work()`` in a multi-process run, chosen by this
    process alone, so it refuses arrays that JAX knows span processes.
    """

    def __init__(self, call: PagedCall, backend: Backend, explanation: Explanation, *,
                 present: bool, options: Any = None, local: bool = False):
        assert isinstance(backend, PagedBackend)
        self.call = call
        self.backend = backend
        self._paged: PagedBackend = backend
        self.explanation = explanation
        self.present = present
        self.options = options
        self.local = local
        self.layout = backend.cache_layout(call)
        self._guard = _no_gradient(backend.name)

    def __repr__(self) -> str:
        return (f"<PagedAttention {self.call.describe()} backend={self.backend.name!r} "
                f"layout={self.layout!r}>")

    def explain(self) -> Explanation:
        """Every backend's verdict for this paged call (made at ``get_paged``)."""
        return self.explanation

    def _require_present(self, x: Any) -> None:
        """Refuse to run for a platform JAX does not see; tracing (``jax.export``
        for it) is allowed, and lowering for another platform is refused by
        :func:`on_platforms`, as for dense calls."""
        if not self.present and not isinstance(x, jax.core.Tracer):
            raise PlatformUnavailableError(unavailable_message([self.explanation.platform]))

    def _require_local(self, what: str, cache: Any, **arrays: Any) -> None:
        """Refuse a local paged attention's ``what`` on ``arrays`` or ``cache``
        (checked after this) that span processes, before anything is traced."""
        if self.local:  # a multi-process run's: choose/local.py is loaded there
            from .local import require_local, spans

            arrays.update({f"cache[{i}]": a
                           for i, a in enumerate(getattr(cache, "arrays", ()))})
            require_local(f"paged attention {self.call.describe()} ({what})", spans(arrays))

    def _on_platform(self, fn: Callable[..., Any], placeholder: Callable[..., Any],
                     *args: Any) -> Any:
        """``fn(*args)`` lowered for the selected platform only (docs/DESIGN.md,
        section 4: lowering for another one raises PlatformUnavailableError)."""
        return on_platforms({self.explanation.platform: fn}, placeholder, *args)

    def init_cache(self, num_pages: int) -> KVCache:
        """A zero-filled cache of ``num_pages`` pages in the serving backend's layout
        (made on the host's default device; for an export, ``jax.eval_shape`` it)."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
                or num_pages < 1:
            raise ValueError(f"num_pages: expected a static int >= 1, got {num_pages!r}")
        return self._paged.init_cache(self.call, int(num_pages))

    def _check_cache(self, cache: Any) -> None:
        num_pages = getattr(cache, "num_pages", 1)
        expected = jax.eval_shape(lambda: self._paged.init_cache(self.call, num_pages))
        check_cache(self.call, cache, self.layout, expected)

    def write(self, cache: KVCache, k: Any, v: Any, slots: Any) -> KVCache:
        """The cache with k, v ``[T, Hkv, D]`` at ``slots`` int ``[T]`` (``page *
        page_size + offset``; negative: padding, writes nothing). Functional: jit it
        with ``donate_argnums`` for the cache to update in place."""
        self._require_present(k)
        self._require_local("write", cache, k=k, v=v, slots=slots)
        self._check_cache(cache)
        check_write(self.call, k, v, slots)
        known = _concrete(slots)
        flat = cache.num_pages * self.call.page_size
        if known is not None and known.size and known.max() >= flat:
            raise ValueError(f"slots: expected each < num_pages * page_size = {flat} (or "
                             f"negative for padding), got {int(known.max())}")
        def write(arrays: Any, k: Any, v: Any, slots: Any) -> Any:
            written = self._paged.write(self.call, KVCache(arrays, *static), k, v, slots)
            return written.arrays

        static = (cache.layout, cache.page_size, cache.num_pages)
        arrays = self._on_platform(write, lambda arrays, *_: arrays, cache.arrays, k, v,
                                   jnp.asarray(slots, jnp.int32))
        return KVCache(tuple(arrays), *static)

    def __call__(self, q: Any, cache: KVCache, batch: PagedBatch) -> Any:
        """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` in q's dtype; rows past
        ``cu_q_lens[num_seqs]`` are zeros."""
        self._require_present(q)
        self._require_local("call", cache, q=q)
        self._check_cache(cache)
        check_attend(self.call, q, batch)
        batch = PagedBatch(*(jnp.asarray(x, jnp.int32) for x in batch[:3]),
                           jnp.asarray(batch.num_seqs, jnp.int32).reshape(()))
        known = [_concrete(x) for x in batch]
        if all(x is not None for x in known):
            cu, kv, table, num = known
            check_batch_values(self.call, q.shape[0], cache.num_pages, cu, kv, table, int(num))
        manual = varying_axes(q, *cache.arrays)
        if manual and not self._paged.paged_capabilities.check_vma:
            raise UnsupportedError(
                f"paged attention {self.call.describe()}: its backend {self.backend.name!r} "
                f"cannot run where q and the cache vary over the manual axes {sorted(manual)} "
                "of a jax.shard_map with check_vma=True (PagedCapabilities.check_vma is not "
                "claimed): pass check_vma=False to that shard_map, or get the paged attention "
                "with a backend that claims it (registry.get_paged(backend=...))")
        call = dataclasses.replace(self.call, platform=self.explanation.platform)
        q, arrays = self._guard(q, cache.arrays)
        static = (cache.layout, cache.page_size, cache.num_pages)

        def attend(q: Any, arrays: Any, batch: PagedBatch) -> Any:
            with jax.named_scope(f"attn_paged/{self.backend.name}"):
                return self._paged.attend_paged(call, q, KVCache(arrays, *static), batch,
                                                self.options)

        out = self._on_platform(attend, lambda q, *_: jnp.zeros_like(q), q, arrays, batch)
        if self.call.max_q_len is not None:
            out = _flag_long_sequences(out, batch, self.call.max_q_len)
        return out

    def to_canonical(self, cache: KVCache) -> tuple[Any, ...]:
        """K and V ``[num_pages, page_size, Hkv, D]``: the layout-free view, exact; for
        a quantized cache also K's and V's scales, float32 ``[num_pages, page_size,
        Hkv]`` (four arrays)."""
        self._check_cache(cache)
        return tuple(self._paged.to_canonical(self.call, cache))

    def from_canonical(self, k_pages: Any, v_pages: Any, k_scales: Any = None,
                       v_scales: Any = None) -> KVCache:
        """A cache in this backend's layout holding K and V ``[num_pages, page_size,
        Hkv, D]`` (from another attention's ``to_canonical``), exact. A quantized
        call's K and V are its ``kv_dtype`` values, with their scales float32
        ``[num_pages, page_size, Hkv]`` (``x ~= value * scale``)."""
        from ..contract.paged_bind import check_canonical

        arrays = check_canonical(self.call, k_pages, v_pages, k_scales, v_scales)
        return self._paged.from_canonical(self.call, *arrays)
