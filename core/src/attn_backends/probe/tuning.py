"""Tuning tables: measured choices between backends, recorded to be reviewed,
committed and replayed (docs/DESIGN.md, "Measured selection").

A table is a JSON file of sections, one per environment (platform, device kind,
jax, jaxlib and libtpu versions). A section's entries are keyed by a *shape
class*: the call's static features exactly (dtype, head counts and dims, every
flag) with batch, query length and key length bucketed by :data:`BUCKET_RULE`,
and whether the call was timed forward only or forward and backward. An entry
keeps every candidate's median and spread (and compile time, never used to
rank), the priority choice it was measured against, and the winner by
:func:`decide`'s margin rule.

Reading a table never times anything. An entry counts only while the
environment and the code it measured are unchanged: each candidate's version
and the digests of its package and of core (:mod:`.digests`), since a rebuild
under the same version changes the kernel. Backends are stored by name.

Writers (two ``attn-backends tune`` processes, say) take a lock file beside the
table, merge what is on disk with their entries (theirs win for the same
class) and replace the file atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..choose.select import Measured
from ..contract.backend import Backend, hookimpl
from ..contract.call import AttentionCall
from ..contract.environment import device_kind, tuning_table, versions
from ..contract.errors import AttnBackendsWarning, warn
from .digests import code_digests
from .store import write_atomically

#: Version of the file's layout; a file of another format is refused with a message.
TABLE_FORMAT = 1
#: How batch and lengths are bucketed: rounded up to a power of two (0 stays 0),
#: so one entry covers, say, every batch of 5 to 8. Part of every table's name
#: for its keys: a table bucketed by another rule is refused, never misread.
BUCKET_RULE = "pow2-v1"
#: What a section's environment holds; any difference voids the section.
ENVIRONMENT_FIELDS = ("platform", "device_kind", "jax", "jaxlib", "libtpu")
#: How much faster (relative to the priority choice's median) a candidate must be
#: to replace the priority choice, besides being outside both spreads.
DEFAULT_MARGIN = 0.05
#: The call fields bucketed by :data:`BUCKET_RULE`; every other field is exact.
BUCKETED = ("batch", "q_len", "kv_len")

#: ``identity(name) -> {"version", "backend", "core"}`` of an installed backend
#: (None: not installed), what an entry's candidates are compared with.
Identity = Callable[[str], "dict[str, str | None] | None"]


class TuningWarning(AttnBackendsWarning):
    """A tuning table's entry for a call is void here (measured in another
    environment, or on code that changed since): selection uses the priority order."""


class TableError(ValueError):
    """A tuning table file that cannot be used (not JSON, another format or bucket
    rule); the message names the file and what to do."""


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): 1, 2, 4, 8, ..."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def shape_class(call: AttentionCall, grad: bool) -> dict[str, Any]:
    """The key an entry is stored under: ``call``'s fields, batch and lengths
    bucketed, the platform left out (the section holds it), and ``grad``."""
    fields = asdict(call)
    fields.pop("platform", None)
    if fields.get("kv_dtype") is None:  # a plain call keeps the key tables wrote before it
        fields.pop("kv_dtype", None)
    for name in BUCKETED:
        fields[name] = bucket(fields[name])
    fields["grad"] = grad
    # JSON has no tuples: the stored key and a computed one must compare equal.
    return json.loads(json.dumps(fields))


def class_key(cls: Mapping[str, Any]) -> str:
    """One string per shape class (sorted JSON)."""
    return json.dumps(cls, sort_keys=True)


@dataclass(frozen=True)
class Timing:
    """One candidate's measurement: the median and spread (median absolute
    deviation) of its per-round times, in seconds; compile time, recorded only."""

    median_s: float
    spread_s: float
    compile_s: float
    rounds: int

    @classmethod
    def of(cls, times: list[float], compile_s: float) -> Timing:
        """From per-round times (each the mean of a round's runs)."""
        ordered = sorted(times)
        median = _median(ordered)
        spread = _median(sorted(abs(t - median) for t in ordered))
        return cls(median, spread, compile_s, len(times))


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def decide(timings: Mapping[str, Timing], default: str,
           margin: float = DEFAULT_MARGIN) -> tuple[str, str]:
    """The winner and why: ``default`` (the priority choice) unless a candidate's
    median is faster by ``margin`` and the two spreads do not overlap; then the
    fastest such candidate. Noise never flips a winner: a tie keeps ``default``."""
    if default not in timings:
        raise ValueError(f"decide: the priority choice {default!r} has no timing; "
                         f"timed: {sorted(timings)}")
    base = timings[default]
    faster = sorted(
        (t.median_s, name) for name, t in timings.items()
        if name != default and t.median_s * (1 + margin) <= base.median_s
        and t.median_s + t.spread_s < base.median_s - base.spread_s)
    if not faster:
        return default, (f"priority choice: no candidate faster than {default} by "
                         f"{margin:.0%} and outside the spread")
    median, name = faster[0]
    return name, f"measured: {base.median_s / median:.2f}x faster than {default}"


@dataclass(frozen=True)
class TableEntry:
    """One shape class's measurement. ``candidates`` maps a backend name to its
    identity (version, digests) and its :class:`Timing` fields, or ``failed``
    with the reason (never a winner)."""

    shape_class: dict[str, Any]
    default: str
    winner: str
    reason: str
    margin: float
    candidates: dict[str, dict[str, Any]]
    measured_at: str

    def summary(self) -> str:
        """Each candidate's median and spread, fastest first, or why it failed."""
        timed = sorted((c["median_s"], n) for n, c in self.candidates.items() if "median_s" in c)
        parts = [f"{n} {1e3 * m:.3g}±{1e3 * self.candidates[n]['spread_s']:.2g} ms"
                 for m, n in timed]
        parts += [f"{n} failed" for n, c in sorted(self.candidates.items()) if "failed" in c]
        return ", ".join(parts)

    def void_reasons(self, identity: Identity) -> list[str]:
        """Why this entry no longer describes the installed code (empty: it does)."""
        reasons = []
        for name, measured in sorted(self.candidates.items()):
            now = identity(name)
            if now is None:
                if name in (self.winner, self.default):
                    reasons.append(f"{name} is not installed")
                continue
            for part in ("version", "backend", "core"):
                if measured.get(part) != now.get(part):
                    what = "version" if part == "version" else f"{part} digest"
                    reasons.append(f"{name}'s {what} changed ({measured.get(part)} then, "
                                   f"{now.get(part)} now)")
        return reasons


@dataclass
class Section:
    """A table's entries for one environment (:data:`ENVIRONMENT_FIELDS`)."""

    environment: dict[str, str | None]
    entries: dict[str, TableEntry] = field(default_factory=dict)

    def differences(self, now: Mapping[str, str | None]) -> list[str]:
        return [f"{f} {self.environment.get(f)} then, {now.get(f)} now"
                for f in ENVIRONMENT_FIELDS if self.environment.get(f) != now.get(f)]


@dataclass
class TuningTable:
    """A tuning table: sections by environment. ``path`` is where it was read."""

    sections: list[Section] = field(default_factory=list)
    path: Path | None = None

    def section(self, environment: Mapping[str, str | None]) -> Section:
        """The section for ``environment``, made if missing."""
        for section in self.sections:
            if not section.differences(environment):
                return section
        section = Section({f: environment.get(f) for f in ENVIRONMENT_FIELDS})
        self.sections.append(section)
        return section

    def add(self, environment: Mapping[str, str | None], entry: TableEntry) -> None:
        self.section(environment).entries[class_key(entry.shape_class)] = entry

    def as_dict(self) -> dict[str, Any]:
        return {"format": TABLE_FORMAT, "bucket_rule": BUCKET_RULE,
                "sections": [{"environment": s.environment,
                              "entries": [asdict(e) for _, e in sorted(s.entries.items())]}
                             for s in self.sections]}

    @classmethod
    def from_dict(cls, data: Any, path: Path | None = None) -> TuningTable:
        where = f"tuning table {path}" if path else "tuning table"
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise TableError(f"{where}: expected format {TABLE_FORMAT}, got {found!r}; "
                             "make it again with `attn-backends tune`")
        if data.get("bucket_rule") != BUCKET_RULE:
            raise TableError(f"{where}: bucketed by {data.get('bucket_rule')!r}, this "
                             f"attn-backends reads {BUCKET_RULE!r}; make it again with "
                             "`attn-backends tune`")
        try:
            sections = [Section(dict(s["environment"]),
                                {class_key(e["shape_class"]): TableEntry(**e)
                                 for e in s["entries"]})
                        for s in data["sections"]]
        except (KeyError, TypeError) as exc:
            raise TableError(f"{where}: malformed ({type(exc).__name__}: {exc}); make it "
                             "again with `attn-backends tune`") from exc
        return cls(sections, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TuningTable:
        """Read ``path``; TableError names the file when it is not a table."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise TableError(f"tuning table {path}: cannot be read ({exc.strerror}); "
                             "check the path given as tuning= or ATTN_BACKENDS_TUNING") from exc
        except ValueError as exc:
            raise TableError(f"tuning table {path}: not JSON ({exc}); make it again with "
                             "`attn-backends tune`") from exc
        return cls.from_dict(data, path)

    def save(self, path: str | os.PathLike[str]) -> TuningTable:
        """Merge into the table at ``path`` (this table's entries win) and replace
        it atomically, under a lock another writer waits for; the merged table."""
        path = Path(path)
        with _locked(path):
            merged = TuningTable.load(path) if path.exists() else TuningTable()
            for section in self.sections:
                for entry in section.entries.values():
                    merged.add(section.environment, entry)
            write_atomically(path, (json.dumps(merged.as_dict(), indent=1) + "\n").encode())
        merged.path = path
        return merged


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` exclusively (POSIX ``flock``; elsewhere no lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: writers are not serialised there
        yield
        return
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Lookup:
    """What a table says for one call: the entry (None: a miss), the winner it
    names when the entry counts, and why the section or entry is void."""

    entry: TableEntry | None
    winner: str | None
    void: tuple[str, ...] = ()

    def note(self, table: TuningTable) -> str:
        """One line for ``explain``."""
        where = f"table {table.path}" if table.path else "tuning table"
        if self.entry is None:
            return f"{where}: " + ("void: " + "; ".join(self.void) if self.void
                                   else "no entry for this shape class")
        when = self.entry.measured_at
        if self.void:
            return f"{where}: entry of {when} void: " + "; ".join(self.void)
        return f"{self.entry.reason} ({self.entry.summary()}), {where}, {when}"


def lookup(table: TuningTable, call: AttentionCall, grad: bool,
           environment: Mapping[str, str | None], identity: Identity) -> Lookup:
    """The table's answer for ``call`` (timed with or without ``grad``) here."""
    key = class_key(shape_class(call, grad))
    for section in table.sections:
        if not section.differences(environment):
            entry = section.entries.get(key)
            if entry is None:
                return Lookup(None, None)
            void = tuple(entry.void_reasons(identity))
            return Lookup(entry, None if void else entry.winner, void)
    covering = [s for s in table.sections if key in s.entries]
    if covering:
        return Lookup(None, None, ("measured in another environment: "
                                   + ", ".join(covering[0].differences(environment)),))
    return Lookup(None, None)


def now_stamp() -> str:
    """The date an entry is measured at (UTC, ISO 8601 to the second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def environment(platform: str) -> dict[str, str | None]:
    """This process's environment for ``platform`` (:data:`ENVIRONMENT_FIELDS`)."""
    found = versions()
    return {"platform": platform, "device_kind": device_kind(platform), "jax": found["jax"],
            "jaxlib": found["jaxlib"], "libtpu": found["libtpu"]}


def identity(backends: Mapping[str, Backend]) -> Identity:
    """``name -> {"version", "backend", "core"}`` of the installed ``backends``."""

    def of(name: str) -> dict[str, str | None] | None:
        backend = backends.get(name)
        if backend is None:
            return None
        digests = code_digests(backend)
        return {"version": backend.version, "backend": digests["backend"],
                "core": digests["core"]}

    return of


class TableReader:
    """What selection consults (:data:`attn_backends.choose.select.Tuning`): a
    table's word on a call. Tables are read once per file version (its mtime and
    size); a void entry warns once per table and reason."""

    def __init__(self) -> None:
        self._tables: dict[Path, tuple[tuple[int, int], TuningTable]] = {}
        self._warned: set[tuple[Path, str]] = set()
        self._lock = threading.Lock()

    def load(self, path: Path) -> TuningTable:
        try:
            stat = path.stat()
        except OSError:
            return TuningTable.load(path)  # raises TableError naming the file
        version = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._tables.get(path)
            if cached is not None and cached[0] == version:
                return cached[1]
        table = TuningTable.load(path)
        with self._lock:
            self._tables[path] = (version, table)
        return table

    @hookimpl(trylast=True)
    def attn_backends_measured(self, table: Path, call: AttentionCall, platform: str,
                               grad: bool, backends: Mapping[str, Backend]) -> Measured | None:
        """Core's ``attn_backends_measured`` (contract/backend.py)."""
        return self(table, call, platform, grad, backends)

    def __call__(self, given: str | os.PathLike[str] | None, call: AttentionCall, platform: str,
                 grad: bool, backends: Mapping[str, Backend]) -> Measured | None:
        path = tuning_table(given)
        if path is None:
            return None
        table = self.load(path)
        found = lookup(table, call, grad, environment(platform), identity(backends))
        note = found.note(table)
        if found.void:
            with self._lock:
                first = (path, note) not in self._warned
                self._warned.add((path, note))
            if first:
                warn(f"{note}; selection uses the priority order. Refresh the table with "
                     "`attn-backends tune`", TuningWarning)
        return Measured(found.winner, note)


def table_summary(given: str | os.PathLike[str] | None, platform: str,
                  backends: Mapping[str, Backend]) -> dict[str, Any] | None:
    """What ``attn-backends list`` says of the table selection reads (None: none):
    its path, how many entries count here, the void ones' reasons, and how many
    were measured in other environments; or why it cannot be read."""
    path = tuning_table(given)
    if path is None:
        return None
    try:
        table = TuningTable.load(path)
    except TableError as exc:
        return {"path": str(path), "problem": str(exc)}
    now, ids = environment(platform), identity(backends)
    counting, void, elsewhere = 0, [], 0
    for section in table.sections:
        if section.differences(now):
            elsewhere += len(section.entries)
            continue
        for entry in section.entries.values():
            reasons = entry.void_reasons(ids)
            counting += not reasons
            void += [r for r in reasons if r not in void]
    return {"path": str(path), "counting": counting, "void": void,
            "other_environments": elsewhere}
