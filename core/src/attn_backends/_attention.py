"""The callable model code uses: ``attention(q, k, v, ...)`` per docs/DESIGN.md, section 2."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from ._backend import Backend
from ._contract import AttentionCall, Operands, bind
from ._dispatch import Served, unavailable_message
from ._errors import FallbackWarning, NoBackendError, PlatformUnavailableError, warn, UnsupportedError
from ._guards import empty_result
from ._select import Explanation, select
from ._sharded_run import explain_sharded, sharded_attention
from ._sharding import Layout, ShardingRequest, resolve_layout

if TYPE_CHECKING:
    from ._registry import Registry

#: Distinct call signatures one Attention remembers; older ones are evicted.
SELECTION_CACHE_SIZE = 512


class Attention:
    """Attention bound to a platform and a selection policy; get it from ``registry.get``.

    ``attention(q, k, v, *, scale=None, causal=False, window=None,
    segment_ids=None, q_lengths=None, kv_lengths=None, mask=None, bias=None,
    softcap=None, return_lse=False)`` with q ``[B, Tq, Hq, D]``, k
    ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` returns out ``[B, Tq, Hq, Dv]``
    (and lse ``[B, Hq, Tq]`` float32 with ``return_lse=True``). Selection
    runs once per call signature, at trace time under ``jit``; the selected
    backend is lowered only for its platform (``platforms``: one, or several
    for a program exported for each). Inputs sharded
    on a mesh (or ``sharding`` from ``registry.get(mesh=, spec=,
    sequence_axis=)``) are served per device, or as ring attention when the
    sequence is sharded (docs/MANY_CHIPS.md).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        platforms: tuple[tuple[str, bool], ...],
        backend: str | None,
        prefer: tuple[str, ...],
        fallback: str,
        backend_options: dict[str, Any],
        sharding: ShardingRequest | None = None,
    ):
        self.registry = registry
        #: (platform, present here) per platform served; ``platform`` is the first.
        self.platforms = platforms
        self.platform, self.present = platforms[0]
        self.backend_name = backend
        self.prefer = prefer
        self.fallback = fallback
        self.backend_options = backend_options
        self.sharding = sharding
        # Keyed by the registry's generation too, so a reload or register()
        # is seen by Attention objects made before it.
        self._selections: OrderedDict[tuple[int, str, AttentionCall, Layout | None], Backend] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        # Held while a new signature is selected, so threads tracing the same
        # signature at once select, probe and warn once (others wait for it).
        self._selecting = threading.RLock()

    def __repr__(self) -> str:
        pinned = f" backend={self.backend_name!r}" if self.backend_name else ""
        where = "/".join(p for p, _ in self.platforms)
        return f"<Attention platform={where!r}{pinned} fallback={self.fallback!r}>"

    def explain_call(
        self, call: AttentionCall, call_for: Callable[[Backend], AttentionCall] | None = None,
        platform: str | None = None, **judging: Any,
    ) -> Explanation:
        """Verdicts for an already-bound call on ``platform`` (default: the first
        platform; ``call_for`` and ``judging`` (``calls_for``, ``reasons_for``): see
        :func:`select`)."""
        platform = self.platform if platform is None else platform
        backends = self.registry.backends
        if self.backend_name is not None:
            backends = {self.backend_name: self.registry.backend(self.backend_name)}
        origins = self.registry.origins
        return select(
            call,
            platform,
            list(backends.values()),
            jax_version=jax.__version__,
            present=dict(self.platforms)[platform],
            prefer=self.prefer,
            distributions={name: origin.distribution for name, origin in origins.items()},
            probe=self.registry.probe,
            call_for=call_for,
            options=self.backend_options,
            **judging,
        )

    def explain(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Explanation:
        """Every backend's verdict for this call; arrays or ``jax.ShapeDtypeStruct``s."""
        call, _ = bind(q, k, v, **kwargs)
        layout = resolve_layout(self.sharding, q, k, v)
        if layout is not None:
            return explain_sharded(self, call, layout)
        return self.explain_call(call)

    def backend_for(
        self, call: AttentionCall, layout: Layout | None = None, platform: str | None = None
    ) -> Backend:
        """The backend serving ``call`` (laid out as ``layout``) on ``platform`` (default:
        the first), selecting on first sight."""
        platform = self.platform if platform is None else platform
        key = (self.registry.generation, platform, call, layout)
        cached = self._cached(key)
        if cached is not None:
            return cached
        with self._selecting:
            cached = self._cached(key)
            if cached is not None:
                return cached
            explanation = (
                self.explain_call(call, platform=platform) if layout is None
                else explain_sharded(self, call, layout)
            )
            chosen = self._choose(call, explanation, platform)
            with self._lock:
                self._selections[key] = chosen
                while len(self._selections) > SELECTION_CACHE_SIZE:
                    self._selections.popitem(last=False)
        return chosen

    def _cached(self, key: tuple[int, str, AttentionCall, Layout | None]) -> Backend | None:
        with self._lock:
            cached = self._selections.get(key)
            if cached is not None:
                self._selections.move_to_end(key)
            return cached

    def _choose(self, call: AttentionCall, explanation: Explanation, platform: str) -> Backend:
        if explanation.chosen is None:
            reasons = {v.backend: list(v.reasons) for v in explanation.verdicts}
            if self.backend_name is not None:
                raise UnsupportedError(
                    f"backend={self.backend_name!r} cannot serve {call.describe()} on "
                    f"{platform}: " + "; ".join(reasons.get(self.backend_name, []))
                )
            raise NoBackendError(
                f"no backend can serve {call.describe()} on {platform}:", reasons
            )
        passed = explanation.passed_over
        if passed and self.fallback != "silent":
            detail = "; ".join(f"{v.backend}: {', '.join(v.reasons)}" for v in passed)
            message = (
                f"attention {call.describe()} on {platform} is served by "
                f"{explanation.chosen!r}, passing over {detail}"
            )
            if self.fallback == "error":
                raise UnsupportedError(message + " (fallback='error')")
            warn(message, FallbackWarning)
        return self.registry.backend(explanation.chosen)

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        scale: float | None = None,
        causal: bool = False,
        window: tuple[int | None, int | None] | None = None,
        segment_ids: tuple[Any, Any] | None = None,
        q_lengths: Any = None,
        kv_lengths: Any = None,
        mask: Any = None,
        bias: Any = None,
        softcap: float | None = None,
        return_lse: bool = False,
    ) -> Any:
        call, operands = bind(
            q, k, v, scale=scale, causal=causal, window=window, segment_ids=segment_ids,
            q_lengths=q_lengths, kv_lengths=kv_lengths, mask=mask, bias=bias,
            softcap=softcap, return_lse=return_lse,
        )
        if call.is_empty:
            with jax.named_scope("attn/empty"):
                return empty_result(call, q)
        if not any(present for _, present in self.platforms) and not isinstance(
            q, jax.core.Tracer
        ):
            raise PlatformUnavailableError(unavailable_message([p for p, _ in self.platforms]))
        layout = resolve_layout(self.sharding, q, k, v)
        if layout is not None:
            if len(self.platforms) > 1:
                raise ValueError(
                    "sharded attention runs on one platform: get it with one device, "
                    f"not {[p for p, _ in self.platforms]}"
                )
            return sharded_attention(self, call, layout, q, k, v, operands)
        served = {p: self.backend_for(call, platform=p) for p, _ in self.platforms}
        return Served.of(served, self.backend_options)(call, q, k, v, operands)

    def run_backend(
        self, backend: Backend, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands
    ) -> Any:
        """Call ``backend`` on the whole (global) arrays, as core calls every backend."""
        return self.served(backend)(call, q, k, v, operands)

    def served(self, backend: Backend) -> Served:
        """``backend`` bound to this attention's platform and options, as core calls it."""
        return Served.of({self.platform: backend}, self.backend_options)
