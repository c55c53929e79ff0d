"""Many hosts: every process of a ``jax.distributed`` run chooses the same backend.

Each host of a TPU pod slice or GPU cluster runs one JAX process, and every
process traces the same SPMD program: if two chose different backends for one
call they would compile different programs, and the run would hang in a
collective or compute garbage. So when ``jax.process_count() > 1`` every
selection (dense, paged, the flax adapter's, explain's) but local work (a call
on this process's devices only: ``attn_backends.choose.local``) ends here:

1. this process judges the backends for the call as it would alone (manifest
   and ``check`` for every one, the probe, on a device of its own, in its order
   until one passes; those ranked below are *deferred*) and publishes its
   *offer*, the backends it serves and defers with their versions and the
   order it ranks them in, through the key-value store of JAX's coordination
   service (the one ``jax.distributed.initialize`` starts);
2. it reads every other process's offer, waiting at most
   ``ATTN_BACKENDS_AGREE_TIMEOUT_S`` (default 300 s) for each exchange;
3. all take one rule over the same offers (:func:`decide`): the first backend in
   process 0's order that every process serves, at the same version, under the
   same jax and jaxlib. Where that first candidate is deferred somewhere, each
   process that deferred it probes it, and all exchange offers again (a step;
   usually none is needed, as every process probed the same first choice).
   Where no backend is served by all, every process gets the same
   :class:`~attn_backends.AgreementError`, naming what each could serve.

Probing only what the rule reaches gives the choice probing everything would
(the rule reads the offers in one fixed order), at the cost of one probe per
process instead of one per installed backend.

A process that does not publish in time (it died, hangs, or traces another
program) is named in an AgreementError on every process that waited for it.
The single-process path never reaches this module (docs/MANY_CHIPS.md, "Many
hosts").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..choose.select import Explanation, Rejudge, Verdict
from ..contract import jax_api
from ..contract.backend import hookimpl
from ..contract.environment import env_setting, seconds
from ..contract.errors import AgreementError, AgreementWarning, warn

#: Seconds a process waits for the others' offers at each exchange of one selection.
DEFAULT_TIMEOUT_S = 300.0
#: Where offers live in the coordination service's key-value store.
KEY_PREFIX = "attn_backends/agree/v2"
#: Reasons per refused backend carried in an offer (the first say why).
_REASONS_KEPT = 2


class KeyValueStore(Protocol):
    """What agreement uses of JAX's distributed runtime client."""

    def key_value_set(self, key: str, value: str) -> None: ...

    def key_value_try_get(self, key: str) -> str: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...


def agree_timeout_s() -> float:
    """``ATTN_BACKENDS_AGREE_TIMEOUT_S``: seconds each exchange of offers waits for all."""
    return env_setting("ATTN_BACKENDS_AGREE_TIMEOUT_S", seconds,
                       accepts="a number of seconds > 0", default=DEFAULT_TIMEOUT_S)


def offer(explanation: Explanation, process: int, host: str) -> dict[str, Any]:
    """What this process publishes: its ranking, the backends it serves and those
    it deferred (name -> version), why it refuses the others, with its jax and
    jaxlib versions."""
    from ..contract.environment import versions

    found = versions()
    return {
        "process": process,
        "host": host,
        "jax": found["jax"],
        "jaxlib": found["jaxlib"],
        "order": [v.backend for v in explanation.verdicts],
        "serves": {v.backend: v.version for v in explanation.verdicts
                   if v.accepted and not v.deferred},
        "deferred": {v.backend: v.version for v in explanation.verdicts if v.deferred},
        "refuses": {v.backend: list(v.reasons[:_REASONS_KEPT])
                    for v in explanation.verdicts if not v.accepted},
        "chosen": explanation.chosen,
    }


@dataclass(frozen=True)
class Decision:
    """The rule's outcome: the backend every process serves (None: there is none),
    a line for people, and why each backend the others rank is not served by all."""

    chosen: str | None
    note: str
    #: backend -> reasons naming the processes that cannot serve it.
    refused: dict[str, tuple[str, ...]]
    #: Whether some process would have chosen otherwise alone.
    overruled: bool
    #: The first candidate some process deferred: no choice yet, it must be
    #: probed there first (then ``chosen`` is None and ``note`` says so).
    pending: str | None = None


def _who(one: dict[str, Any]) -> str:
    return f"process {one['process']} ({one['host']})"


def _serves_line(one: dict[str, Any]) -> str:
    serves = ", ".join(f"{name} {version}" for name, version in one["serves"].items())
    line = f"{_who(one)} serves {serves or 'nothing'}"
    deferred = ", ".join(one["deferred"])
    return line + (f" (not probed: {deferred})" if deferred else "")


def decide(offers: Sequence[dict[str, Any]]) -> Decision:
    """One rule every process takes over the same offers (sorted by process): the
    first backend in process 0's order that every process serves at one version,
    under one jax and jaxlib; or, where some process deferred that backend's
    probe, that backend as ``pending``."""
    offers = sorted(offers, key=lambda o: o["process"])
    lines = "; ".join(_serves_line(o) for o in offers)
    stacks = {(o["jax"], o["jaxlib"]) for o in offers}
    if len(stacks) > 1:
        detail = "; ".join(f"{_who(o)} runs jax {o['jax']}, jaxlib {o['jaxlib']}"
                           for o in offers)
        return Decision(None, f"the {len(offers)} processes run different jax versions, so "
                        f"they would compile different programs: {detail}. Install one jax "
                        "and jaxlib on every host", {}, True)
    refused: dict[str, tuple[str, ...]] = {}
    chosen = None
    order = list(offers[0]["order"])
    order += sorted({n for o in offers for n in o["order"]} - set(order))
    for name in order:
        why = []
        for one in offers:
            if name not in one["order"]:
                why.append(f"{_who(one)} does not have it (not installed, or left out by "
                           "ATTN_BACKENDS_ONLY / ATTN_BACKENDS_DISABLE there)")
            elif name in one["refuses"]:
                why.append(f"{_who(one)} refuses it: " + "; ".join(one["refuses"][name]))
        held = [{**one["deferred"], **one["serves"]} for one in offers]
        versions = {mine[name] for mine in held if name in mine}
        if not why and len(versions) > 1:
            why.append("the processes hold different versions: " + ", ".join(
                f"{_who(o)} {mine[name]}" for o, mine in zip(offers, held, strict=True)))
        if why:
            refused[name] = tuple(why)
        elif chosen is None:
            if any(name in one["deferred"] for one in offers):
                return Decision(None, f"{name} is to be probed where it was deferred",
                                refused, False, pending=name)
            chosen = name
    overruled = any(o["chosen"] != chosen for o in offers)
    if chosen is None:
        return Decision(None, f"no backend is served by all {len(offers)} processes: "
                        f"{lines}. Install the same backends at the same versions on every "
                        "host (`attn-backends explain` on each says why it refuses one)",
                        refused, overruled)
    note = (f"{len(offers)} processes agree on {chosen}, the first in process 0's order "
            "that every process serves")
    alone = [f"{_who(o)} would choose {o['chosen']}" for o in offers if o["chosen"] != chosen]
    if alone:
        note += " (alone, " + ", ".join(alone) + ")"
    return Decision(chosen, note, refused, overruled)


def agreed(explanation: Explanation, decision: Decision,
           order: Sequence[str]) -> Explanation:
    """``explanation`` as the run decided: verdicts in process 0's ``order``, a
    backend this process serves but another does not rejected with the other's
    reason (so the fallback warning names it), and the agreed choice."""
    position = {name: i for i, name in enumerate(order)}
    verdicts: list[Verdict] = []
    for verdict in sorted(explanation.verdicts,
                          key=lambda v: position.get(v.backend, len(position))):
        others = decision.refused.get(verdict.backend, ())
        if verdict.accepted and others:
            verdict = dataclasses.replace(verdict, accepted=False,
                                          reasons=verdict.reasons + others)
        verdicts.append(verdict)
    return dataclasses.replace(explanation, verdicts=tuple(verdicts), chosen=decision.chosen,
                               agreement=decision.note)


def _published(client: KeyValueStore, key: str) -> bool:
    """Whether ``key`` holds a value now (the store raises NOT_FOUND when it does not)."""
    try:
        client.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - NOT_FOUND: the answer is "no"
        return False
    return True


def _digest(question: Hashable) -> str:
    return hashlib.sha256(repr(question).encode()).hexdigest()[:24]


class Hosts:
    """The registry's agreement across processes: ``hosts(explanation, question,
    rejudge)``, ``rejudge`` probing what this process deferred when the rule
    reaches it.

    ``store`` is the coordination service's key-value client (None: the one
    ``jax.distributed.initialize`` made), ``process``/``count`` this process's
    index and the number of processes (None: JAX's). A question decided once is
    not asked again while this process's own offer for it is unchanged, so
    ``explain`` after a call, on one process alone, costs no exchange.
    """

    def __init__(self, *, store: KeyValueStore | None = None, process: int | None = None,
                 count: int | None = None, timeout_s: float | None = None):
        self._store = store
        self._process = process
        self._count = count
        self.timeout_s = agree_timeout_s() if timeout_s is None else timeout_s
        self._host = socket.gethostname()
        self._rounds: dict[str, int] = {}
        self._decided: dict[tuple[str, str], Explanation] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @hookimpl(trylast=True)
    def attn_backends_agree(self, explanation: Explanation, question: Hashable,
                            rejudge: Rejudge) -> Explanation:
        """Core's ``attn_backends_agree`` (contract/backend.py)."""
        return self(explanation, question, rejudge)

    def __call__(self, explanation: Explanation, question: Hashable,
                 rejudge: Rejudge) -> Explanation:
        import jax

        process = jax.process_index() if self._process is None else self._process
        count = jax.process_count() if self._count is None else self._count
        mine = offer(explanation, process, self._host)
        digest = _digest(question)
        memo = (digest, json.dumps(mine, sort_keys=True))
        with self._lock:
            known = self._decided.get(memo)
            if known is not None:
                return known
            round_ = self._rounds.get(digest, 0)
            self._rounds[digest] = round_ + 1
            probed: set[str] = set()
            # Every process reads the same offers at each step, so all take the
            # same steps; each step settles its pending backend everywhere.
            for step in range(len(explanation.verdicts) + 1):
                offers = self._exchange(f"{KEY_PREFIX}/{digest}/{round_}/{step}", mine, process,
                                        count, explanation)
                decision = decide(offers)
                if decision.pending is None:
                    break
                if decision.pending in mine["deferred"]:
                    probed.add(decision.pending)
                    explanation = rejudge(frozenset(probed))
                    mine = offer(explanation, process, self._host)
            first = min(offers, key=lambda o: o["process"])
            result = agreed(explanation, decision, first["order"])
            self._decided[memo] = result
        if decision.chosen is not None and decision.overruled and decision.note not in self._warned:
            self._warned.add(decision.note)
            warn(f"{explanation.call.describe()} on {explanation.platform}: "
                 f"{decision.note}", AgreementWarning)
        return result

    def _client(self) -> KeyValueStore:
        if self._store is not None:
            return self._store
        client = jax_api.distributed_client()
        if client is None:
            raise AgreementError(
                "this run has several JAX processes but no coordination service to agree "
                "through: start every process with jax.distributed.initialize(...) before "
                "the first attention call")
        return client

    def _exchange(self, key: str, mine: dict[str, Any], process: int, count: int,
                  explanation: Explanation) -> list[dict[str, Any]]:
        """Publish ``mine`` under ``key`` and read every other process's offer."""
        client = self._client()
        what = f"{explanation.call.describe()} on {explanation.platform}"
        try:
            client.key_value_set(f"{key}/{process}", json.dumps(mine))
        except Exception as exc:
            raise AgreementError(f"agreeing on a backend for {what}: process {process} could "
                                 f"not publish its offer to JAX's coordination service: "
                                 f"{exc}") from exc
        offers = {process: mine}
        deadline = time.monotonic() + self.timeout_s
        for other in range(count):
            if other in offers:
                continue
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                offers[other] = json.loads(client.blocking_key_value_get(f"{key}/{other}",
                                                                         left_ms))
            except Exception as exc:
                text = str(exc)
                if "DEADLINE_EXCEEDED" in text:
                    missing = [p for p in range(count)
                               if p not in offers and not _published(client, f"{key}/{p}")]
                    raise AgreementError(
                        f"agreeing on a backend for {what}: no offer from process(es) "
                        f"{missing} within {self.timeout_s:g} s (ATTN_BACKENDS_AGREE_TIMEOUT_S)"
                        ": they died, hang, or trace another program. Every process must "
                        "make the same attention calls, except local work: a call only this "
                        "process makes (e.g. under `if jax.process_index() == 0:`) on its "
                        "own devices. Make it, or trace it, inside `with "
                        "attn_backends.local_work():` to choose its backend here alone "
                        "(docs/MANY_CHIPS.md, \"Local work\")") from exc
                raise AgreementError(
                    f"agreeing on a backend for {what}: process {process} lost JAX's "
                    f"coordination service while waiting for process {other}: "
                    f"{text.splitlines()[0] if text else type(exc).__name__}") from exc
        return [offers[p] for p in range(count)]
