"""The callable model code uses: ``attention(q, k, v, ...)`` per docs/DESIGN.md, section 2.

A single-device call is a straight line: :func:`bind`, selection (once per call
signature, cached), :class:`Served`. An input laid out on a mesh, or an attention
got with ``mesh=``, ``spec=`` or ``sequence_axis=``, is handed to the parallel
layer, which sits above this one, through its hooks (contract/backend.py), with only
:class:`SingleDevice`, the callables it needs.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Unpack

import jax

from ..contract.backend import Backend
from ..contract.call import AttentionCall, AttentionKeywords, Operands
from ..contract.environment import is_sharded, process_count, tuning_table, varying_axes
from ..contract.errors import (
    AgreementError,
    FallbackWarning,
    NoBackendError,
    PlatformUnavailableError,
    UnsupportedError,
    warn,
)
from .dispatch import (
    Served,
    by_pass,
    empty_result,
    manual_axes_judging,
    single_device_only,
    unavailable_message,
)
from .select import LOCAL_WORK, Explanation, Judging, Measured, record, select

#: Distinct call signatures one Attention remembers; older ones are evicted.
SELECTION_CACHE_SIZE = 512

#: The layouts of q, k, v (and the output) an Attention takes: ``registry.get(layout=)``.
#: BTNH is the contract's ``[B, T, H, D]``; BHTD is PyTorch's ``[B, H, T, D]``.
LAYOUTS = ("BTNH", "BHTD")


@dataclass(frozen=True)
class SingleDevice:
    """The single-device selection the parallel layer wraps, as callables.

    - ``platforms``: the platforms this attention serves (the first is its own);
    - ``explain(call, *, calls_for=None, reasons_for=None)``: every backend's
      verdict (:class:`~attn_backends.choose.select.Judging`'s fields of those names);
    - ``choose(call, key, explain)``: the backend for ``call`` under the extra
      cache ``key`` (a layout), running ``explain()`` and the fallback policy on
      first sight only;
    - ``served(backend)``: that backend bound as core calls every backend;
    - ``backend(name)``: a registered backend by name;
    - ``on(mesh)``: this selection for the call laid out on ``mesh``, which
      decides, with the operands, whether it is local work (choose/local.py).

    ``explain`` and ``choose`` select as local work or agreed, as the call's
    operands (and ``on``'s mesh) say.
    """

    platforms: tuple[str, ...]
    explain: Callable[..., Explanation]
    choose: Callable[[AttentionCall, Hashable, Callable[[], Explanation]], Backend]
    served: Callable[[Backend], Served]
    backend: Callable[[str], Backend]
    on: Callable[[Any], SingleDevice]


class Attention:
    """Attention bound to a platform and a selection policy; get it from ``registry.get``.

    ``attention(q, k, v, *, scale=None, causal=False, window=None,
    segment_ids=None, q_lengths=None, kv_lengths=None, mask=None, bias=None,
    softcap=None, return_lse=False, dropout_rate=0.0, dropout_key=None,
    k_scales=None, v_scales=None)`` (the keywords of
    :class:`~attn_backends.contract.call.AttentionKeywords`) with q ``[B, Tq, Hq, D]``, k
    ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]`` returns out ``[B, Tq, Hq, Dv]``
    (and lse ``[B, Hq, Tq]`` float32 with ``return_lse=True``). With
    ``layout="BHTD"`` q, k, v and out are ``[B, H, T, D]`` instead, transposed
    to and from the contract's layout here; lse, mask, bias, ids, lengths and
    scales have the same shapes in both layouts. Selection
    runs once per call signature, at trace time under ``jit``; the selected
    backend is lowered only for its platform (``platforms``: one, or several
    for a program exported for each). Inputs sharded on a mesh (or a
    ``sharding`` request from ``registry.get(mesh=, spec=, sequence_axis=)``)
    go to the parallel layer: per device, or ring attention when the sequence
    is sharded (docs/MANY_CHIPS.md).
    """

    def __init__(
        self,
        registry: Any,
        *,
        platforms: tuple[tuple[str, bool], ...],
        backend: str | None,
        prefer: tuple[str, ...],
        fallback: str,
        backend_options: dict[str, Any],
        sharding: Hashable | None = None,
        layout: str = "BTNH",
        tuning: Any = None,
    ):
        if layout not in LAYOUTS:
            raise ValueError(
                f"layout: expected one of {LAYOUTS} (the axes of q, k, v and the output: "
                f"BTNH = [B, T, H, D], BHTD = [B, H, T, D]), got {layout!r}"
            )
        #: The :class:`~attn_backends.Registry` it selects from.
        self.registry = registry
        #: The axes of q, k, v and the output this attention takes and returns.
        self.layout = layout
        #: (platform, present here) per platform served; ``platform`` is the first.
        self.platforms = platforms
        self.platform, self.present = platforms[0]
        self.backend_name = backend
        self.prefer = prefer
        self.fallback = fallback
        self.backend_options = backend_options
        #: The parallel layer's request (None: lay out by the inputs' own sharding).
        self.sharding = sharding
        #: The tuning table asked for (None: ATTN_BACKENDS_TUNING or the cache's).
        self.tuning = tuning
        # Keyed by the registry's generation too, so a reload or register()
        # is seen by Attention objects made before it; and by whether it was
        # local work, so a choice made alone never serves a call all agree on.
        self._selections: OrderedDict[tuple[int, str, AttentionCall, Hashable, bool],
                                      Backend] = OrderedDict()
        self._lock = threading.Lock()
        # Held while a new signature is selected, so threads tracing the same
        # signature at once select, probe and warn once (others wait for it).
        self._selecting = threading.RLock()

    def __repr__(self) -> str:
        pinned = f" backend={self.backend_name!r}" if self.backend_name else ""
        where = "/".join(p for p, _ in self.platforms)
        layout = "" if self.layout == "BTNH" else f" layout={self.layout!r}"
        return f"<Attention platform={where!r}{pinned} fallback={self.fallback!r}{layout}>"

    def explain_call(self, call: AttentionCall, platform: str | None = None, grad: bool = False,
                     *, local: bool = False, **judging: Any) -> Explanation:
        """Verdicts for an already-bound call on ``platform`` (default: the first
        platform; ``judging``: ``calls_for``, ``reasons_for`` of
        :class:`~attn_backends.choose.select.Judging`), the tuning table's entry
        for the call forward (or, with ``grad``, forward and backward) consulted.
        In a multi-process run the processes agree on the choice
        (docs/MANY_CHIPS.md, "Many hosts") unless it is ``local`` work, chosen by
        this process alone ("Local work")."""
        platform = self.platform if platform is None else platform
        backends = self.registry.backends
        if self.backend_name is not None:
            backends = {self.backend_name: self.registry.backend(self.backend_name)}
        features = self.registry.features
        agree = (features.hook("attn_backends_agree") if process_count() > 1 and not local
                 else None)
        base = Judging(
            jax_version=jax.__version__, present=dict(self.platforms)[platform],
            prefer=self.prefer,
            distributions={n: o.distribution for n, o in self.registry.origins.items()},
            probe=features.hook("attn_backends_probe"), options=self.backend_options,
            measured=self.measured(call, platform, grad), **judging)

        def judge(probe_also: frozenset[str] = frozenset()) -> Explanation:
            return select(call, platform, list(backends.values()),
                          dataclasses.replace(base, probe_also=probe_also))

        explanation = judge()
        if local:
            return dataclasses.replace(explanation, agreement=LOCAL_WORK)
        if agree is None:
            return explanation
        # What names this selection in every process: the call and everything
        # of this attention that changes its candidates or their order.
        question = ("dense", call, platform, grad, self.backend_name, self.prefer,
                    tuple(sorted(self.backend_options)), str(self.tuning),
                    tuple(sorted(judging)))
        return agree(explanation, question, judge)

    def measured(self, call: AttentionCall, platform: str, grad: bool) -> Measured | None:
        """The tuning table's word on ``call`` (None: no table, or ``backend=`` pinned)."""
        if self.backend_name is not None:
            return None
        table = tuning_table(self.tuning)  # asked first: no table, no reader loaded
        reader = None if table is None else self.registry.features.hook("attn_backends_measured")
        return None if reader is None else reader(table, call, platform, grad,
                                                  self.registry.backends)

    def explain(self, q: Any, k: Any, v: Any, *, grad: bool = False,
                **kwargs: Any) -> Explanation:
        """Every backend's verdict for this call; arrays or ``jax.ShapeDtypeStruct``s,
        in this attention's ``layout`` (the explanation's call is in the contract's).
        ``grad``: the choice for the call differentiated, which differs only when a
        tuning table timed its backward pass to another winner."""
        if self.layout == "BHTD":
            from .bhtd import to_contract_layout

            q, k, v = to_contract_layout(q, k, v)
        from ..contract.arguments import bind

        call, operands = bind(q, k, v, **kwargs)
        if self._goes_parallel(q):
            return self._parallel("attn_backends_sharded_explain", call, q, k, v, operands)
        return self.explain_call(call, grad=grad and self._tuned_apart(call, self.platform),
                                 local=self._is_local(call, q, k, v, operands),
                                 **manual_axes_judging(varying_axes(q, k, v, operands)))

    def backend_for(self, call: AttentionCall, platform: str | None = None,
                    grad: bool = False, *, local: bool = False,
                    manual: frozenset[str] = frozenset()) -> Backend:
        """The backend serving ``call`` on ``platform`` (default: the first),
        selecting on first sight; with ``grad``, the one serving it when it is
        differentiated (another only when a tuning table says so); with
        ``local``, the one this process chooses alone for its local work; with
        ``manual``, inside a user's shard_map whose manual axes q, k, v vary over."""
        platform = self.platform if platform is None else platform
        key = "grad" if grad else None
        judging = manual_axes_judging(manual)
        return self._choose(call, (key, "check_vma") if manual else key,
                            lambda: self.explain_call(call, platform=platform, grad=grad,
                                                      local=local, **judging),
                            platform, local=local)

    def _choose(self, call: AttentionCall, key: Hashable, explain: Callable[[], Explanation],
                platform: str | None = None, *, local: bool = False) -> Backend:
        platform = self.platform if platform is None else platform
        cache_key = (self.registry.generation, platform, call, key, local)
        cached = self._cached(cache_key)
        if cached is not None:
            return cached
        with self._selecting:
            cached = self._cached(cache_key)
            if cached is not None:
                return cached
            chosen = self._apply_policy(call, explain(), platform)
            with self._lock:
                self._selections[cache_key] = chosen
                while len(self._selections) > SELECTION_CACHE_SIZE:
                    self._selections.popitem(last=False)
        return chosen

    def _cached(self, key: tuple[int, str, AttentionCall, Hashable, bool]) -> Backend | None:
        with self._lock:
            cached = self._selections.get(key)
            if cached is not None:
                self._selections.move_to_end(key)
            return cached

    def _apply_policy(self, call: AttentionCall, explanation: Explanation,
                      platform: str) -> Backend:
        if explanation.disagreed:
            raise AgreementError(explanation.agreement)
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

    def __call__(self, q: Any, k: Any, v: Any, **kwargs: Unpack[AttentionKeywords]) -> Any:
        if self.layout == "BTNH":
            return self._attend(q, k, v, **kwargs)
        # Transposed in and out: under jit XLA gives the backend's matmuls these
        # dimension orders (docs/DESIGN.md, section 2, says what compiles).
        from .bhtd import swap_heads_and_length, to_contract_layout

        result = self._attend(*to_contract_layout(q, k, v), **kwargs)
        if kwargs.get("return_lse"):
            out, lse = result
            return swap_heads_and_length(out), lse
        return swap_heads_and_length(result)

    def _attend(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        """The call in the contract's BTNH layout."""
        # Loaded by the first call (at trace time under jit), not at import.
        from ..contract.arguments import bind

        call, operands = bind(q, k, v, **kwargs)
        record(call)
        if call.is_empty:
            with jax.named_scope("attn/empty"):
                return empty_result(call, q)
        if not any(present for _, present in self.platforms) and not isinstance(
            q, jax.core.Tracer
        ):
            raise PlatformUnavailableError(unavailable_message([p for p, _ in self.platforms]))
        if self._goes_parallel(q):
            return self._parallel("attn_backends_sharded_call", call, q, k, v, operands)
        return self._served_for(call, q, k, v, operands)(call, q, k, v, operands)

    def _served_for(self, call: AttentionCall, q: Any, k: Any, v: Any,
                    operands: Operands) -> Served:
        """The backends serving ``call`` on one device: one per platform of the
        program, chosen alone in a multi-process run's local work, for a user's
        shard_map when q, k, v vary over its manual axes, and a second one for
        the differentiated call when a tuning table timed it apart."""
        local, manual = self._is_local(call, q, k, v, operands), varying_axes(q, k, v, operands)
        served = {p: self.backend_for(call, platform=p, local=local, manual=manual)
                  for p, _ in self.platforms}
        forward = Served.of(served, self.backend_options)
        trained = {p: self.backend_for(call, platform=p, grad=True, local=local, manual=manual)
                   for p, _ in self.platforms if self._tuned_apart(call, p)}
        if not trained or all(trained[p] is served[p] for p in trained):
            return forward
        # A table measured another backend fastest forward and backward: the
        # primal runs the forward winner, a differentiated call the other.
        return by_pass(forward, Served.of({**served, **trained}, self.backend_options))

    def _tuned_apart(self, call: AttentionCall, platform: str) -> bool:
        """Whether the table times ``call`` forward and backward to a winner of its own."""
        found = self.measured(call, platform, True)
        return found is not None and found.backend is not None

    def served(self, backend: Backend) -> Served:
        """``backend`` bound to this attention's platform and options, as core calls it."""
        return Served.of({self.platform: backend}, self.backend_options)

    def _goes_parallel(self, q: Any) -> bool:
        # q decides: k and v must share its layout, which the parallel layer checks.
        return self.sharding is not None or is_sharded(q)

    def _parallel(self, hook: str, call: AttentionCall, q: Any, k: Any, v: Any,
                  operands: Operands) -> Any:
        """``call`` laid out on a mesh, through the parallel layer's ``hook``
        (contract/backend.py); UnsupportedError for a call served on a single device
        only (dispatch.single_device_only says why)."""
        refusal = single_device_only(call)
        if refusal is not None:
            raise UnsupportedError(refusal)
        sharded = self.registry.features.hook(hook)
        if sharded is None:
            raise UnsupportedError("q is sharded over mesh axes, and this registry's parallel "
                                   "layer is blocked (Registry(block=['parallel']))")
        where = functools.partial(self._is_local, call, q, k, v, operands)
        selection = self._single_device(where)
        if hook == "attn_backends_sharded_call":
            return sharded(selection, self.sharding, call, q, k, v, operands)
        return sharded(selection, self.sharding, call, q, k, v)

    def _is_local(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
                  mesh: Any = None) -> bool:
        """Whether ``call`` on these operands (laid out on ``mesh``) is local work,
        chosen by this process alone (choose/local.py); never on one process,
        where nothing is agreed."""
        if process_count() == 1:
            return False
        from .local import is_local  # multi-process runs only: not loaded before

        arrays = {"q": q, "k": k, "v": v,
                  **{name: x for name, x in operands._asdict().items() if x is not None}}
        meshes = [] if mesh is None else [(mesh, "the mesh it is laid out on")]
        return is_local(f"attention {call.describe()}", arrays, meshes)

    def _single_device(self, where: Callable[[Any], bool], mesh: Any = None) -> SingleDevice:
        """The selection callables for the parallel layer; ``where(mesh)`` says
        whether the call laid out on ``mesh`` is local work."""
        local = where(mesh)
        return SingleDevice(
            platforms=tuple(p for p, _ in self.platforms),
            explain=functools.partial(self.explain_call, local=local),
            choose=lambda call, key, explain: self._choose(call, key, explain, local=local),
            served=self.served,
            backend=self.registry.backend,
            on=functools.partial(self._single_device, where),
        )
