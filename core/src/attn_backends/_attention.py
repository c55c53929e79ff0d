"""The callable model code uses: ``attention(q, k, v, ...)`` per docs/DESIGN.md, section 2."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from ._backend import Backend
from ._contract import AttentionCall, Operands, bind
from ._errors import FallbackWarning, NoBackendError, PlatformUnavailableError, warn, UnsupportedError
from ._guards import empty_result, no_gradient, refuse_unclaimed
from ._platform import visible_platforms
from ._select import Explanation, select
from ._sharding import Layout, ShardingRequest, explain_sharded, resolve_layout, sharded_attention

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
    runs once per call signature, at trace time under ``jit``. Inputs sharded
    on a mesh (or ``sharding`` from ``registry.get(mesh=, spec=,
    sequence_axis=)``) are served per device, or as ring attention when the
    sequence is sharded (docs/MANY_CHIPS.md).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        platform: str,
        present: bool,
        backend: str | None,
        prefer: tuple[str, ...],
        fallback: str,
        backend_options: dict[str, Any],
        sharding: ShardingRequest | None = None,
    ):
        self.registry = registry
        self.platform = platform
        self.present = present
        self.backend_name = backend
        self.prefer = prefer
        self.fallback = fallback
        self.backend_options = backend_options
        self.sharding = sharding
        # Keyed by the registry's generation too, so a reload or register()
        # is seen by Attention objects made before it.
        self._selections: OrderedDict[tuple[int, AttentionCall, Layout | None], Backend] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        # Held while a new signature is selected, so threads tracing the same
        # signature at once select, probe and warn once (others wait for it).
        self._selecting = threading.RLock()

    def __repr__(self) -> str:
        pinned = f" backend={self.backend_name!r}" if self.backend_name else ""
        return f"<Attention platform={self.platform!r}{pinned} fallback={self.fallback!r}>"

    def explain_call(
        self, call: AttentionCall, call_for: Callable[[Backend], AttentionCall] | None = None
    ) -> Explanation:
        """Verdicts for an already-bound call (``call_for``: see :func:`select`)."""
        backends = self.registry.backends
        if self.backend_name is not None:
            backends = {self.backend_name: self.registry.backend(self.backend_name)}
        origins = self.registry.origins
        return select(
            call,
            self.platform,
            list(backends.values()),
            jax_version=jax.__version__,
            present=self.present,
            prefer=self.prefer,
            distributions={name: origin.distribution for name, origin in origins.items()},
            probe=self.registry.probe,
            call_for=call_for,
            options=self.backend_options,
        )

    def explain(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Explanation:
        """Every backend's verdict for this call; arrays or ``jax.ShapeDtypeStruct``s."""
        call, _ = bind(q, k, v, **kwargs)
        layout = resolve_layout(self.sharding, q, k, v)
        if layout is not None:
            return explain_sharded(self, call, layout)
        return self.explain_call(call)

    def backend_for(self, call: AttentionCall, layout: Layout | None = None) -> Backend:
        """The backend serving ``call`` (laid out as ``layout``), selecting on first sight."""
        key = (self.registry.generation, call, layout)
        cached = self._cached(key)
        if cached is not None:
            return cached
        with self._selecting:
            cached = self._cached(key)
            if cached is not None:
                return cached
            explanation = (
                self.explain_call(call) if layout is None else explain_sharded(self, call, layout)
            )
            chosen = self._choose(call, explanation)
            with self._lock:
                self._selections[key] = chosen
                while len(self._selections) > SELECTION_CACHE_SIZE:
                    self._selections.popitem(last=False)
        return chosen

    def _cached(self, key: tuple[int, AttentionCall, Layout | None]) -> Backend | None:
        with self._lock:
            cached = self._selections.get(key)
            if cached is not None:
                self._selections.move_to_end(key)
            return cached

    def _choose(self, call: AttentionCall, explanation: Explanation) -> Backend:
        if explanation.chosen is None:
            reasons = {v.backend: list(v.reasons) for v in explanation.verdicts}
            if self.backend_name is not None:
                raise UnsupportedError(
                    f"backend={self.backend_name!r} cannot serve {call.describe()} on "
                    f"{self.platform}: " + "; ".join(reasons.get(self.backend_name, []))
                )
            raise NoBackendError(
                f"no backend can serve {call.describe()} on {self.platform}:", reasons
            )
        passed = explanation.passed_over
        if passed and self.fallback != "silent":
            detail = "; ".join(f"{v.backend}: {', '.join(v.reasons)}" for v in passed)
            message = (
                f"attention {call.describe()} on {self.platform} is served by "
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
        if not self.present and not isinstance(q, jax.core.Tracer):
            raise PlatformUnavailableError(
                f"device={self.platform!r}: JAX sees no {self.platform} here (visible: "
                f"{', '.join(visible_platforms()) or 'none'}). Selection for an absent "
                "platform serves ahead-of-time export only: trace it with "
                f"jax.export.export(jax.jit(f), platforms=[{self.platform!r}])."
            )
        layout = resolve_layout(self.sharding, q, k, v)
        if layout is not None:
            return sharded_attention(self, call, layout, q, k, v, operands)
        return self.run_backend(self.backend_for(call), call, q, k, v, operands)

    def run_backend(
        self, backend: Backend, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands
    ) -> Any:
        """Call ``backend`` on the whole (global) arrays, guarded and named."""
        refuse_unclaimed(backend, call)
        q, k, v, operands = _guard_gradients(backend, q, k, v, operands)
        with jax.named_scope(f"attn/{backend.name}"):
            return backend.attend(
                call, q, k, v, operands, self.backend_options.get(backend.name)
            )


def _guard_gradients(
    backend: Backend, q: Any, k: Any, v: Any, operands: Operands
) -> tuple[Any, Any, Any, Operands]:
    """Make a gradient the backend does not implement fail loudly, never silently."""
    caps = backend.capabilities
    if not caps.differentiable:
        message = f"backend {backend.name!r} is not differentiable (capabilities)"
        q, k, v = (no_gradient(x, message) for x in (q, k, v))
    if operands.bias is not None and not caps.bias_grad:
        message = f"backend {backend.name!r} has no gradient w.r.t. bias (bias_grad=False)"
        operands = operands._replace(bias=no_gradient(operands.bias, message))
    return q, k, v, operands
