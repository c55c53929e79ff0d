"""The probe policy: when a backend is probed, what a verdict covers, where it is kept.

Selection asks the registry's :class:`Prober` about a backend only once
every check before it has passed, and only until the first backend in rank
order is accepted. A verdict is about the backend's *canonical probe call*
for the caller's call (:mod:`.call`: shape classes kept, lengths
made canonical) under the caller's options for that backend; its key
(:func:`probe_key`) holds that call, the options, the backend's name,
version and code digest, core's digest, the jax/jaxlib/libtpu versions,
platform and device kind. The verdict is kept in memory (bounded) and on
disk (:mod:`.verdicts`, on :mod:`.store`), so every process sharing the cache reuses it.

A stored certificate that still counts (:mod:`.certificates`: same
environment, same code) stands for a passed probe of calls with default
options. The dense oracle is core's own (:mod:`attn_backends.oracle`), so
probes never depend on another distribution being installed.

Paged calls (:meth:`Prober.paged`, handed to paged selection) follow the same
rules: their verdict key holds the :class:`~attn_backends.PagedCall` itself (it
has no lengths to make canonical), and :mod:`.paged_run` runs the probe.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..contract.backend import Backend, hookimpl
from ..contract.call import AttentionCall, bindable
from ..contract.environment import device_kind, env_setting, seconds, versions
from . import call as _probe_call
from . import certificates as _certificates
from . import verdicts as _verdicts
from .digests import code_digests

if TYPE_CHECKING:
    from ..contract.paged import PagedCall

logger = logging.getLogger("attn_backends")

#: Probe wall-time budget (compile included), seconds; env ATTN_BACKENDS_PROBE_BUDGET_S.
DEFAULT_BUDGET_S = 120.0
#: Verdicts one Prober keeps in memory; older ones are evicted (disk keeps them).
MEMORY_CACHE_SIZE = 1024

_SAMPLE_HEAD_DIMS = (64, 128, 32, 256, 16, 8)


def _head_dim(backend: Backend) -> int:
    dims = backend.capabilities.head_dims
    for d in _SAMPLE_HEAD_DIMS:
        if not dims.reasons(d, "head_dim"):
            return d
    return min(dims.allowed) if dims.allowed else dims.multiple_of


def sample_call(backend: Backend, dtype: str, features: frozenset[str]) -> AttentionCall:
    """A representative call (B=2, T=128) using ``features`` in ``dtype``."""
    import jax
    import jax.numpy as jnp

    from ..contract.arguments import bind

    sds = jax.ShapeDtypeStruct
    b, t, d = 2, 128, _head_dim(backend)
    hkv, hq = 2, 4 if "gqa" in features else 2
    kw: dict[str, Any] = {
        "causal": "causal" in features,
        "window": (32, 0) if "window" in features else None,
        "softcap": 30.0 if "softcap" in features else None,
        "return_lse": "return_lse" in features,
    }
    if "segment_ids" in features:
        kw["segment_ids"] = (sds((b, t), jnp.int32), sds((b, t), jnp.int32))
    if "lengths" in features:
        kw["kv_lengths"] = sds((b,), jnp.int32)
    if "mask" in features:
        kw["mask"] = sds((b, 1, t, t), jnp.bool_)
    if "bias" in features:
        kw["bias"] = sds((1, hq, t, t), jnp.dtype(dtype))
    q = sds((b, t, hq, d), jnp.dtype(dtype))
    kv = sds((b, t, hkv, d), jnp.dtype(dtype))
    return bind(q, kv, kv, **kw)[0]


def probe_plan(backend: Backend) -> list[AttentionCall]:
    """Calls `attn-backends probe` checks: each dtype with no feature, causal, and all
    claimed; float64 only under ``jax_enable_x64`` (without it no call is float64)."""
    claimed = backend.capabilities.features
    sets = [frozenset(), frozenset({"causal"}) & claimed, claimed]
    unique = list(dict.fromkeys(sets))
    return [
        sample_call(backend, dtype, fs)
        for dtype in sorted(backend.capabilities.dtypes) if bindable(dtype)
        for fs in unique
    ]


def quarantined(backend: str | None = None) -> list[dict[str, Any]]:
    """Failed verdicts on disk (of ``backend``, or all): key, probe call, reasons, date."""
    return [r for r in _verdicts.records()
            if "unreadable" not in r and not r.get("passed")
            and (backend is None or r.get("key", {}).get("backend") == backend)]


#: XLA status codes that say the machine could not run a program, whatever program.
_ENVIRONMENT_STATUSES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                         "CANCELLED", "ABORTED")


def environment_failure(exc: BaseException) -> bool:
    """Whether a probe's exception is the environment's (memory, a lost device or
    peer, a device this process cannot address), not a fault of the backend."""
    text = str(exc)
    if "non-addressable" in text:
        return True
    return type(exc).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and text.startswith(
        _ENVIRONMENT_STATUSES)


#: ``runner(backend, call, platform, options) -> reasons`` (None: nothing to compare).
Runner = Callable[[Backend, AttentionCall, str, Any], "list[str] | None"]
#: ``paged_runner(backend, call, platform, options) -> reasons`` for paged calls.
PagedRunner = Callable[[Backend, "PagedCall", str, Any], "list[str] | None"]


@dataclass(frozen=True)
class ProbeVerdict:
    """A probe's outcome. ``source``: "run", "disk", "certificate", "timeout",
    "environment" (the machine could not run it; kept in memory only) or "unprobed"."""

    passed: bool
    reasons: tuple[str, ...]
    seconds: float
    source: str


def options_token(options: Any) -> str | None:
    """How the caller's options enter a verdict key: their ``repr`` (None: defaults).

    Frozen dataclasses (the usual block-size configs) have a stable repr; an
    object whose repr names its address is re-probed in each process.
    """
    return (
        None
        if options is None
        else f"{type(options).__module__}.{type(options).__qualname__}:{options!r}"
    )


def probe_key(
    backend: Backend, call: AttentionCall | PagedCall, platform: str, options: Any = None
) -> dict[str, Any]:
    """Everything a verdict depends on; its hash names the cache file. A paged
    call is keyed by itself (``paged_call``), a dense one by its canonical probe
    call (``probe_call``)."""
    digests = code_digests(backend)
    if isinstance(call, AttentionCall):
        probed = {"probe_call": dataclasses.asdict(_probe_call.canonical(call))}
    else:  # a PagedCall (contract/paged.py is not loaded by dense calls)
        probed = {"paged_call": dataclasses.asdict(dataclasses.replace(call, platform=None))}
    return {
        "backend": backend.name,
        "backend_version": backend.version,
        "backend_digest": digests["backend"],
        "core_digest": digests["core"],
        **versions(),
        "platform": platform,
        "device_kind": device_kind(platform),
        "options": options_token(options),
        **probed,
    }


class Prober:
    """The registry's probe: ``prober(backend, call, platform, options) -> reasons``,
    and ``prober.paged(...)`` the same for paged calls.

    ``runner`` and ``paged_runner`` do the comparison (tests substitute fake
    ones). Returns the reasons the backend failed (empty: passed), or None
    when nothing was compared (its ``check`` rejects every probe shape).
    """

    def __init__(self, *, runner: Runner | None = None,
                 paged_runner: PagedRunner | None = None, budget_s: float | None = None):
        # None: core's runners, loaded by the first probe that runs (a verdict
        # on disk needs neither the oracle nor the tolerance table).
        self._runner = runner
        self._paged_runner = paged_runner
        self.budget_s = budget_s if budget_s is not None else env_setting(
            "ATTN_BACKENDS_PROBE_BUDGET_S", seconds, accepts="a number of seconds > 0",
            default=DEFAULT_BUDGET_S)
        self._memory: OrderedDict[str, ProbeVerdict] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(
        self, backend: Backend, call: AttentionCall, platform: str, options: Any = None
    ) -> list[str] | None:
        verdict = self.verdict(backend, call, platform, options)
        return None if verdict.source == "unprobed" else list(verdict.reasons)

    def paged(
        self, backend: Backend, call: PagedCall, platform: str, options: Any = None
    ) -> list[str] | None:
        """The paged probe handed to paged selection: the reasons ``backend`` fails
        the paged ``call`` (empty: it passes), under the dense probe's rules."""
        return self(backend, call, platform, options)

    @hookimpl(trylast=True)
    def attn_backends_probe(self, backend: Backend, call: AttentionCall, platform: str,
                            options: Any) -> list[str] | None:
        """Core's ``attn_backends_probe`` (contract/backend.py)."""
        return self(backend, call, platform, options)

    @hookimpl(trylast=True)
    def attn_backends_probe_paged(self, backend: Backend, call: PagedCall, platform: str,
                                  options: Any) -> list[str] | None:
        """Core's ``attn_backends_probe_paged``."""
        return self.paged(backend, call, platform, options)

    def verdict(
        self, backend: Backend, call: AttentionCall | PagedCall, platform: str,
        options: Any = None,
    ) -> ProbeVerdict:
        """The cached verdict for this key (dense or paged call), probing first if
        there is none."""
        key = probe_key(backend, call, platform, options)
        digest = _verdicts.digest(key)
        with self._lock:
            cached = self._memory.get(digest)
            if cached is not None:
                self._memory.move_to_end(digest)
                return cached
        verdict = (
            self._from_certificate(backend, platform) if options is None else None
        ) or self._read(key)
        if verdict is None:
            verdict = self._run(backend, call, platform, options)
            if verdict.source == "unprobed":
                return verdict  # nothing learnt: try again for the next signature
            if verdict.source == "run":
                self._write(key, verdict, call)
        with self._lock:
            self._memory[digest] = verdict
            if len(self._memory) > MEMORY_CACHE_SIZE:
                self._memory.popitem(last=False)
        return verdict

    def forget(self) -> None:
        """Drop the in-memory verdicts (after ``attn-backends probe --clear``)."""
        with self._lock:
            self._memory.clear()

    @property
    def memory_size(self) -> int:
        return len(self._memory)

    def _run(
        self, backend: Backend, call: AttentionCall | PagedCall, platform: str, options: Any
    ) -> ProbeVerdict:
        start = time.perf_counter()
        runner: Callable[..., Any] | None = (
            self._runner if isinstance(call, AttentionCall) else self._paged_runner)
        if runner is None and isinstance(call, AttentionCall):
            from .run import run_probe as runner
        elif runner is None:
            from .paged_run import run_paged_probe as runner
        # Selection runs while the caller's function is being traced, and JAX's
        # trace state is per thread: a worker thread runs the probe eagerly on
        # concrete arrays instead of joining the caller's program, and bounds
        # its time. It runs in a copy of the caller's context, so context-local
        # switches (e.g. flash_pallas' interpret_mode()) hold there too.
        context = contextvars.copy_context()
        done: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)

        def work() -> None:
            try:
                done.put(("ok", context.run(runner, backend, call, platform, options)))
            except Exception as exc:  # noqa: BLE001 - handed to the caller below
                done.put(("raised", exc))

        # A daemon thread: a probe that never finishes must not keep the
        # process alive after the caller has moved on.
        threading.Thread(target=work, name=f"attn-probe-{backend.name}", daemon=True).start()
        source = "run"
        try:
            status, value = done.get(timeout=self.budget_s)
        except queue.Empty:
            status, value = "timeout", None
        if status == "ok":
            outcome = value
        elif status == "raised":
            first_line = (str(value).strip().splitlines() or [""])[0][:300]
            outcome = [f"probe raised {type(value).__name__}: {first_line}"]
            if environment_failure(value):
                # The machine, not the backend's answer: kept in memory only, so
                # the next process probes again instead of finding a quarantine.
                source = "environment"
                outcome = [f"{outcome[0]} (this machine could not run the probe; not "
                           "quarantined on disk)"]
        else:
            # Kept in memory only: a slow first compile on a busy machine must
            # not quarantine the backend on disk for good.
            source = "timeout"
            outcome = [
                f"probe did not finish within the {self.budget_s:g} s budget "
                "(ATTN_BACKENDS_PROBE_BUDGET_S)"
            ]
        seconds = time.perf_counter() - start
        if outcome is None:
            return ProbeVerdict(True, (), seconds, "unprobed")
        reasons = list(outcome)
        if reasons:
            logger.warning(
                "backend %r quarantined for %s (attn-backends probe --clear %s forgets it): %s",
                backend.name, call.describe(), backend.name, reasons,
            )
        return ProbeVerdict(not reasons, tuple(reasons), seconds, source)

    def _from_certificate(self, backend: Backend, platform: str) -> ProbeVerdict | None:
        if _certificates.status(backend, platform).counts:
            return ProbeVerdict(True, (), 0.0, "certificate")
        return None

    def _read(self, key: dict[str, Any]) -> ProbeVerdict | None:
        # The store reports an unreadable record (once) and returns None for it.
        data = _verdicts.read(key)
        if data is None:
            return None
        return ProbeVerdict(
            bool(data["passed"]), tuple(data["reasons"]), float(data["seconds"]), "disk"
        )

    def _write(self, key: dict[str, Any], verdict: ProbeVerdict,
               call: AttentionCall | PagedCall) -> None:
        probed = _probe_call.canonical(call) if isinstance(call, AttentionCall) else call
        record = {
            "passed": verdict.passed,
            "reasons": list(verdict.reasons),
            "seconds": verdict.seconds,
            "source": verdict.source,
            "probe_call": probed.describe(),
            "first_seen_on": call.describe(),
        }
        # An unwritable cache keeps it in memory, with one warning (the store's).
        _verdicts.write(key, record)
