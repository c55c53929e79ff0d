"""Selection: a plain function of (call, platform, backends, preferences, probes)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..contract.backend import Backend
from ..contract.call import AttentionCall
from ..contract.capabilities import in_range

if TYPE_CHECKING:
    from ..contract.paged import PagedCall

#: ``probe(backend, call, platform, options) -> reasons`` (empty: passed; None:
#: nothing was compared, e.g. the backend's check() rejects every probe shape).
#: ``options`` are the caller's options for that backend (None: defaults):
#: the ``attn_backends_probe`` hook (contract/backend.py) as a function.
Probe = Callable[[Backend, AttentionCall, str, Any], "list[str] | None"]


#: The calls :func:`recording_calls` collects in this context (None: not recording).
_recorded: ContextVar[list[AttentionCall] | None] = ContextVar("attn_backends_recorded",
                                                               default=None)


@contextlib.contextmanager
def recording_calls() -> Iterator[list[AttentionCall]]:
    """Collect, in order and once each, the contract call of every attention call
    made (or traced) inside: what ``attn-backends tune`` times for a program."""
    calls: list[AttentionCall] = []
    token = _recorded.set(calls)
    try:
        yield calls
    finally:
        _recorded.reset(token)


def record(call: AttentionCall) -> None:
    """Note ``call`` for :func:`recording_calls`, when it is recording."""
    recording = _recorded.get()
    if recording is not None and call not in recording:
        recording.append(call)


@dataclass(frozen=True)
class Measured:
    """A tuning table's word on one call (docs/DESIGN.md, "Measured selection"):
    the backend it measured fastest here (None: a miss, or a void entry) and one
    line for people saying what was measured or why it does not count."""

    backend: str | None
    note: str


#: ``rejudge(probe_also) -> explanation``: the same selection judged again, with
#: the backends named in ``probe_also`` probed even where ranked below the
#: chosen one (verdicts already cached cost nothing): what the
#: ``attn_backends_agree`` hook (contract/backend.py) is handed.
Rejudge = Callable[[frozenset[str]], "Explanation"]


@dataclass(frozen=True)
class Judging:
    """How :func:`select` judges, besides the call, the platform and the backends.

    - ``jax_version``: the running jax, against each manifest's range;
    - ``present``: whether the platform is present here (probes run only then);
    - ``prefer``: names tried first, in order;
    - ``distributions``: each backend's distribution, for the verdicts;
    - ``probe``: ``probe(backend, call, platform, options) -> reasons`` (None: no probes);
    - ``options``: the caller's options per backend name (its probe runs under them);
    - ``measured``: a tuning table's word: its backend is tried right after
      ``prefer`` (which still wins) and must pass every step like any other;
    - ``probe_also``: backends probed even when ranked below the chosen one
      (the others there are ``deferred``): a multi-process run agrees on the
      first backend every process serves, and asks for the probe of one this
      process deferred (parallel/hosts.py);
    - ``calls_for``: the calls a backend will really receive, when that differs
      from the caller's (per-device shapes; a ring's per-block calls): checks and
      probes judge each, and it must pass all;
    - ``reasons_for``: reasons of the caller's own per backend (a ring needs lse).
    """

    jax_version: str
    present: bool = True
    prefer: Sequence[str] = ()
    distributions: Mapping[str, str] = field(default_factory=dict)
    probe: Probe | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    measured: Measured | None = None
    probe_also: Collection[str] = ()
    calls_for: Callable[[Backend], Sequence[AttentionCall]] | None = None
    reasons_for: Callable[[Backend], Sequence[str]] | None = None


#: ``Explanation.agreement`` of a multi-process run's call chosen by its process
#: alone: local work, on that process's devices only (choose/local.py).
LOCAL_WORK = "local work, not agreed"

#: What ``explain`` says of a backend given a key mask as segment ids.
KEY_MASK_NOTE = "key mask rewritten as segment ids"


@dataclass(frozen=True)
class Verdict:
    """One backend's answer for one call. ``probed`` is None when no probe ran."""

    backend: str
    version: str
    distribution: str | None
    priority: int
    accepted: bool
    reasons: tuple[str, ...]
    probed: bool | None = None
    #: False when the manifest excludes the platform: such a backend is not
    #: "passed over" (no fallback warning for a TPU kernel on a CPU).
    platform_ok: bool = True
    #: How the call this backend is judged on and given differs from the
    #: caller's (e.g. "key mask rewritten as segment ids").
    notes: tuple[str, ...] = ()
    #: Accepted by manifest and ``check``, its probe not run because it ranks
    #: below the chosen one (a multi-process run may still ask for it).
    deferred: bool = False


@dataclass(frozen=True)
class Explanation:
    """Every backend's verdict for a call (a dense one, or a paged one from
    ``select_paged``), in preference order, and the choice."""

    call: AttentionCall | PagedCall
    platform: str
    present: bool
    verdicts: tuple[Verdict, ...]
    chosen: str | None
    #: What a tuning table said of this call (None: no table was consulted).
    measured: Measured | None = None
    #: How the processes of a multi-process run agreed on ``chosen``, or why they
    #: could not, or :data:`LOCAL_WORK` (None: one process, nothing to agree).
    agreement: str | None = None

    @property
    def disagreed(self) -> bool:
        """Whether ``agreement`` says why the processes found no common backend
        (then ``chosen`` is None)."""
        return self.chosen is None and self.agreement not in (None, LOCAL_WORK)

    @property
    def passed_over(self) -> tuple[Verdict, ...]:
        """Rejected backends ranked above the chosen one that serve this platform."""
        out = []
        for verdict in self.verdicts:
            if verdict.backend == self.chosen:
                break
            if verdict.platform_ok:
                out.append(verdict)
        return tuple(out)

    def as_dict(self) -> dict[str, object]:
        return {
            "call": asdict(self.call),
            "description": self.call.describe(),
            "platform": self.platform,
            "platform_present": self.present,
            "chosen": self.chosen,
            "measured": None if self.measured is None else asdict(self.measured),
            "agreement": self.agreement,
            "verdicts": [{**asdict(v), "reasons": list(v.reasons), "notes": list(v.notes)}
                         for v in self.verdicts],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def __str__(self) -> str:
        status = "" if self.present else " (not present here: manifest only, unprobed)"
        lines = [f"call: {self.call.describe()}", f"platform: {self.platform}{status}"]
        for verdict in self.verdicts:
            mark = "CHOSEN" if verdict.backend == self.chosen else (
                "rejected" if not verdict.accepted else
                "ok (not probed: ranked below the chosen one)" if verdict.deferred else "ok"
            )
            lines.append(f"  {verdict.backend:<16} prio {verdict.priority:>4}  {mark}")
            lines += [f"      - {reason}" for reason in verdict.reasons]
            lines += [f"      = {note}" for note in verdict.notes]
        if self.chosen is None:
            lines.append("  no backend can serve this call")
        if self.measured is not None:
            lines.append(f"tuning: {self.measured.note}")
            if self.measured.backend not in (None, self.chosen):
                lines.append(f"  the table's {self.measured.backend} is not chosen: a prefer= "
                             "name or its verdict above comes first")
        if self.agreement is not None:
            lines.append(f"hosts: {self.agreement}")
        return "\n".join(lines)


def rank(backends: Sequence[Backend], platform: str, prefer: Sequence[str] = ()) -> list[Backend]:
    """Order: names in ``prefer`` first (in that order), then priority, then name.
    (A tuning table's winner joins ``prefer``, after the caller's names.)"""
    position = {name: i for i, name in enumerate(prefer)}
    return sorted(
        backends,
        key=lambda b: (position.get(b.name, len(position)), -b.priority_on(platform), b.name),
    )


def jax_range_reason(backend: Backend, jax_version: str) -> str | None:
    """Why ``backend`` is not selected under ``jax_version`` (None: its range allows it)."""
    spec = backend.capabilities.jax_versions
    if spec and not in_range(jax_version, spec):
        return f"jax {jax_version} is outside the supported range {spec}"
    return None


def _reasons(backend: Backend, call: AttentionCall, platform: str, jax_version: str) -> list[str]:
    reasons = backend.capabilities.unmet(call, platform)
    out_of_range = jax_range_reason(backend, jax_version)
    if out_of_range:
        reasons.append(out_of_range)
    if reasons:
        return reasons
    try:
        return [str(r) for r in backend.check(call)]
    except Exception as exc:  # noqa: BLE001 - a broken check() is a reason, not a crash
        return [f"check() raised {type(exc).__name__}: {exc}"]


def select(call: AttentionCall, platform: str, backends: Sequence[Backend],
           judging: Judging) -> Explanation:
    """Judge every backend for ``call`` on ``platform`` and choose the first survivor.

    Steps: manifest filter, jax version range, ``check(call)``, then the probe
    (only when the platform is present and a probe is given, and only until a
    backend is chosen: those ranked below it are not probed unless named in
    ``judging.probe_also``). Manifest and ``check`` judge each call as the
    backend's manifest has core hand it over
    (:meth:`~attn_backends.Capabilities.served_call`: a key mask as segment ids
    or as a pairwise mask); the probe gets the call itself and runs it the same
    way. A tuning table's backend (``judging.measured``) comes right after the
    names in ``prefer``; a quarantined, refused or missing one leaves the
    priority order.
    """
    verdicts = []
    chosen = None
    j = judging
    order = tuple(j.prefer)
    if j.measured is not None and j.measured.backend not in (None, *order):
        order += (j.measured.backend,)
    for backend in rank(backends, platform, order):
        judged = [call] if j.calls_for is None else list(j.calls_for(backend))
        reasons = [] if j.reasons_for is None else list(j.reasons_for(backend))
        notes: list[str] = []
        for one in judged:
            served = backend.capabilities.served_call(one)
            if one.key_mask and served.mask_shape is None and KEY_MASK_NOTE not in notes:
                notes.append(KEY_MASK_NOTE)
            found = _reasons(backend, served, platform, j.jax_version)
            reasons += [r for r in found if r not in reasons]
        probed = None
        can_probe = not reasons and j.probe is not None and j.present
        deferred = can_probe and chosen is not None and backend.name not in j.probe_also
        if can_probe and not deferred:
            for one in judged:
                outcome = j.probe(backend, one, platform, j.options.get(backend.name))
                probed = bool(probed) or outcome is not None
                reasons += [r for r in outcome or () if r not in reasons]
                if reasons:
                    break
        accepted = not reasons
        if accepted and chosen is None:
            chosen = backend.name
        verdicts.append(
            Verdict(
                backend=backend.name,
                version=backend.version,
                distribution=j.distributions.get(backend.name),
                priority=backend.priority_on(platform),
                accepted=accepted,
                reasons=tuple(reasons),
                probed=probed,
                platform_ok=platform in backend.capabilities.platforms,
                notes=tuple(notes),
                deferred=deferred,
            )
        )
    return Explanation(call, platform, j.present, tuple(verdicts), chosen, j.measured)
