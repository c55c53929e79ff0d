"""Runtime probes: a tiny compile-and-compare against the reference, cached on disk.

The probe of a backend for a key (backend and its version, jax/jaxlib/libtpu,
platform, device kind, dtype, feature set, head dims) runs the backend and the
``reference`` backend on the same small random call, forward and the gradient
w.r.t. q, and compares. The verdict is kept in memory (bounded) and on disk
under the cache directory; a conformance certificate for the same environment
counts as a passed probe. A backend whose probe raises, disagrees or exceeds
the time budget is quarantined for that key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _certificates, _probe_call
from ._backend import Backend
from ._contract import AttentionCall
from ._environment import cache_dir, device_kind, versions
from ._errors import AttnBackendsWarning, warn

logger = logging.getLogger("attn_backends")

REFERENCE = "reference"
#: Max error relative to the reference output's largest magnitude. Loose on
#: purpose: a probe catches a broken kernel (errors of order 1), not rounding;
#: TPU float32 matmuls default to bfloat16 passes, hence 1e-2 for float32.
TOLERANCE = {"float32": 1e-2, "bfloat16": 6e-2, "float16": 2e-2}
#: Probe wall-time budget (compile included), seconds; env ATTN_BACKENDS_PROBE_BUDGET_S.
DEFAULT_BUDGET_S = 120.0
#: Verdicts one Prober keeps in memory; older ones are evicted (disk keeps them).
MEMORY_CACHE_SIZE = 1024


@dataclass(frozen=True)
class ProbeVerdict:
    """A probe's outcome. ``source``: "run", "disk", "certificate", "timeout" or "unprobed"."""

    passed: bool
    reasons: tuple[str, ...]
    seconds: float
    source: str


def probe_key(backend: Backend, call: AttentionCall, platform: str) -> dict[str, Any]:
    """Everything a verdict depends on; its hash names the cache file."""
    return {
        "backend": backend.name,
        "backend_version": backend.version,
        # Includes core's own version: the probe is core's code, so a new
        # core re-probes instead of trusting verdicts of an older one.
        **versions(),
        "platform": platform,
        "device_kind": device_kind(platform),
        "dtype": call.dtype,
        "features": sorted(call.features),
        "head_dim": call.head_dim,
        "v_head_dim": call.v_head_dim,
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _relative_error(got: Any, want: Any) -> float:
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("inf")
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-6)
    return float(np.max(np.abs(got - want), initial=0.0)) / scale


def _finite_rows(got: Any, want: Any) -> tuple[Any, Any]:
    """lse with rows that see no key (``-inf`` in both) set to 0 so they compare
    equal; a row ``-inf`` in only one of them stays non-finite and fails."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    empty = np.isneginf(got) & np.isneginf(want)
    return np.where(empty, 0.0, got), np.where(empty, 0.0, want)


def run_probe(
    backend: Backend, reference: Backend, call: AttentionCall, platform: str
) -> list[str] | None:
    """Compare ``backend`` with ``reference`` on a shrunken ``call``.

    Forward (out, and lse when the call returns it), and the gradient w.r.t.
    q when the backend is differentiable.
    Returns the reasons they differ (empty: they agree), or None when the
    backend's ``check`` rejects every probe shape (nothing to compare).
    """
    import jax

    small = next(
        (c for c in (_probe_call.shrink(call, n) for n in _probe_call.PROBE_LENGTHS)
         if not backend.check(c)),
        None,
    )
    if small is None:
        return None
    q, k, v, ops, d_out = _probe_call.arrays(small)
    with_grad = backend.capabilities.differentiable

    def outputs(impl: Backend) -> dict[str, Any]:
        def f(q: Any) -> tuple[Any, Any]:
            result = impl.attend(small, q, k, v, ops)
            return result if small.return_lse else (result, None)

        named = {}
        if with_grad:
            out, vjp, lse = jax.vjp(f, q, has_aux=True)
            named["dq"] = vjp(d_out)[0]
        else:
            # Not even linearised: a backend without gradients may not allow it.
            out, lse = f(q)
        named["output"] = out
        if lse is not None:
            # Ring attention and split-KV merging trust lse as much as out.
            named["lse"] = lse
        return named

    with jax.default_device(jax.devices(platform)[0]):
        got = jax.jit(lambda: outputs(backend))()
        want = jax.jit(lambda: outputs(reference))()
    tol = TOLERANCE[call.dtype]
    reasons = []
    # jit returns dicts with sorted keys: report in the order of the contract.
    for what in (name for name in ("output", "lse", "dq") if name in want):
        g, w = got[what], want[what]
        if what == "lse":
            g, w = _finite_rows(g, w)
        err = _relative_error(g, w)
        if not err <= tol:
            reasons.append(
                f"probe: {what} differs from the reference by {err:.3g} (relative; "
                f"tolerance {tol:g}) on {small.describe()}"
            )
    return reasons


class Prober:
    """The registry's probe: ``prober(backend, call, platform) -> reasons``.

    ``reference`` returns the reference backend (or None when not installed).
    ``runner`` does the comparison (tests substitute a fake one).
    """

    def __init__(
        self,
        reference: Callable[[], Backend | None],
        *,
        runner: Callable[[Backend, Backend, AttentionCall, str], list[str] | None] = run_probe,
        budget_s: float | None = None,
    ):
        self._reference = reference
        self._runner = runner
        env_budget = os.environ.get("ATTN_BACKENDS_PROBE_BUDGET_S")
        self.budget_s = budget_s if budget_s is not None else float(env_budget or DEFAULT_BUDGET_S)
        self._memory: OrderedDict[str, ProbeVerdict] = OrderedDict()
        self._lock = threading.Lock()
        self._warned_disk = False

    def __call__(self, backend: Backend, call: AttentionCall, platform: str) -> list[str] | None:
        verdict = self.verdict(backend, call, platform)
        return None if verdict.source == "unprobed" else list(verdict.reasons)

    def verdict(self, backend: Backend, call: AttentionCall, platform: str) -> ProbeVerdict:
        """The cached verdict for this key, probing first if there is none."""
        if backend.name == REFERENCE:
            return ProbeVerdict(True, (), 0.0, "unprobed")  # the yardstick itself
        key = probe_key(backend, call, platform)
        digest = _digest(key)
        with self._lock:
            cached = self._memory.get(digest)
            if cached is not None:
                self._memory.move_to_end(digest)
                return cached
        verdict = self._from_certificate(backend, platform) or self._read(digest, key)
        if verdict is None:
            verdict = self._run(backend, call, platform)
            if verdict.source == "unprobed":
                return verdict  # nothing learnt: try again for the next signature
            if verdict.source == "run":
                self._write(digest, key, verdict)
        with self._lock:
            self._memory[digest] = verdict
            if len(self._memory) > MEMORY_CACHE_SIZE:
                self._memory.popitem(last=False)
        return verdict

    @property
    def memory_size(self) -> int:
        return len(self._memory)

    def _run(self, backend: Backend, call: AttentionCall, platform: str) -> ProbeVerdict:
        reference = self._reference()
        if reference is None:
            return ProbeVerdict(True, (), 0.0, "unprobed")
        start = time.perf_counter()
        # Selection runs while the caller's function is being traced, and JAX's
        # trace state is per thread: a worker thread runs the probe eagerly on
        # concrete arrays instead of joining the caller's program, and bounds
        # its time. It runs in a copy of the caller's context, so context-local
        # switches (e.g. flash_pallas' interpret_mode()) hold there too.
        import contextvars
        import queue

        context = contextvars.copy_context()
        done: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)

        def work() -> None:
            try:
                done.put(("ok", context.run(self._runner, backend, reference, call, platform)))
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
            logger.warning("backend %r quarantined for %s: %s", backend.name, call.describe(), reasons)
        return ProbeVerdict(not reasons, tuple(reasons), seconds, source)

    def _from_certificate(self, backend: Backend, platform: str) -> ProbeVerdict | None:
        cert = _certificates.find(backend.name, backend.version, platform)
        if cert is not None and _certificates.is_full_pass(cert):
            return ProbeVerdict(True, (), 0.0, "certificate")
        return None

    def _path(self, digest: str) -> Path:
        return cache_dir() / "probes" / f"{digest}.json"

    def _disk_warning(self, message: str) -> None:
        if not self._warned_disk:
            self._warned_disk = True
            warn(message, AttnBackendsWarning)

    def _read(self, digest: str, key: dict[str, Any]) -> ProbeVerdict | None:
        path = self._path(digest)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data["key"] != key:
                return None
            return ProbeVerdict(bool(data["passed"]), tuple(data["reasons"]), float(data["seconds"]), "disk")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._disk_warning(
                f"probe cache entry {path} is unreadable ({type(exc).__name__}: {exc}); "
                "probing again and keeping the verdict in memory"
            )
            return None

    def _write(self, digest: str, key: dict[str, Any], verdict: ProbeVerdict) -> None:
        path = self._path(digest)
        record = {"key": key, **asdict(verdict)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(record, indent=2))
            tmp.replace(path)
        except OSError as exc:
            self._disk_warning(
                f"probe cache directory {path.parent} is not writable ({exc}); "
                "probe verdicts are kept in memory only (set ATTN_BACKENDS_CACHE_DIR)"
            )


def cached_verdicts() -> list[dict[str, Any]]:
    """Every verdict on disk (for `list` and `doctor`); an unreadable entry is
    returned as ``{"path": ..., "unreadable": reason}``."""
    folder = cache_dir() / "probes"
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            out.append({"path": str(path), "unreadable": f"{type(exc).__name__}: {exc}"})
    return out
