"""The one store of probe verdicts and certificates: JSON objects, one file each,
in a folder of the cache (``ATTN_BACKENDS_CACHE_DIR``).

- A write is atomic: the record goes to a temporary file in the same folder,
  is flushed to disk (fsync), then renamed over the old file (``os.replace``).
  A reader, in this process or another, sees the old record or the new one,
  never half of one; a writer killed mid-write leaves the old file as it was.
- A missing file is no record. A file that cannot be read, is not JSON, is not
  a JSON object, or lacks what its kind of record needs (``check``) is reported
  once with a :class:`StoreWarning` naming the file, and read as no record:
  never a crash, and never a pass.
- When the folder cannot be written, records are kept in memory for this
  process, with one warning per folder.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.environment import cache_dir
from ..contract.errors import AttnBackendsWarning, warn

#: ``check(record) -> problem``: why a JSON object is not a usable record (None: it is).
Check = Callable[[dict[str, Any]], "str | None"]

#: Records one store keeps in memory when its folder is not writable; the oldest go first.
MEMORY_LIMIT = 1024

_temp_names = itertools.count()
#: What has been reported already: (path, mtime, size) of a bad file, or an unwritable folder.
_reported: set[tuple[Any, ...]] = set()
_reported_lock = threading.Lock()


class StoreWarning(AttnBackendsWarning):
    """A stored verdict or certificate was unreadable and is ignored, or the cache
    folder is not writable and records are kept in memory."""


@dataclass(frozen=True)
class Entry:
    """One record of a store: its file, the record, or why it is unusable."""

    path: Path
    record: dict[str, Any] | None
    problem: str | None = None


def _report_once(token: tuple[Any, ...], message: str) -> None:
    with _reported_lock:
        if token in _reported:
            return
        _reported.add(token)
    warn(message, StoreWarning)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path``'s content with ``data`` atomically; raises OSError if it cannot.

    The temporary file is in ``path``'s folder (a rename within one file system
    is atomic), named so that no two writers, threads or processes, share one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    unique = f"{os.getpid()}.{threading.get_ident()}.{next(_temp_names)}"
    temp = path.parent / f".{path.name}.{unique}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(temp, flags, 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    # The rename itself is durable once the folder is synced (POSIX; elsewhere
    # opening a folder fails and there is nothing to do).
    with contextlib.suppress(OSError):
        folder_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder_fd)
        finally:
            os.close(folder_fd)


class Store:
    """JSON records in ``<cache>/<subdir>``, one ``<name>.json`` file each.

    ``what`` names the store in warnings ("probe cache": "probe cache entry
    <file> is unreadable", "probe cache directory <dir> is not writable"),
    ``holds`` what it keeps ("probe verdicts"), ``ignored`` what ignoring an
    unreadable record means ("the backend is probed again"). ``check`` says why
    a JSON object is not a record of this kind (None: it is one).
    """

    def __init__(self, subdir: str, *, what: str, holds: str, ignored: str,
                 check: Check | None = None):
        self.subdir = subdir
        self.what = what
        self.holds = holds
        self.ignored = ignored
        self._check = check
        self._memory: OrderedDict[Path, str] = OrderedDict()
        self._lock = threading.Lock()

    def folder(self) -> Path:
        """Where the records are now (the cache folder is read on every use)."""
        return cache_dir() / self.subdir

    def path(self, name: str) -> Path:
        return self.folder() / f"{name}.json"

    def _parse(self, text: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            record = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return None, f"not valid JSON ({type(exc).__name__}: {exc})"
        if not isinstance(record, dict):
            return None, f"not a JSON object but a JSON {type(record).__name__}"
        problem = self._check(record) if self._check is not None else None
        return (None, problem) if problem else (record, None)

    def _load(self, path: Path) -> Entry | None:
        """The entry for ``path`` (memory first), None when there is no file."""
        with self._lock:
            text = self._memory.get(path)
        if text is None:
            try:
                text = path.read_text(encoding="utf-8")
            except (FileNotFoundError, NotADirectoryError):
                return None
            except (OSError, ValueError) as exc:  # ValueError: not UTF-8
                return Entry(path, None, f"{type(exc).__name__}: {exc}")
        record, problem = self._parse(text)
        return Entry(path, record, problem)

    def _report_unreadable(self, entry: Entry) -> None:
        try:
            stat = entry.path.stat()
            token: tuple[Any, ...] = ("unreadable", str(entry.path), stat.st_mtime_ns, stat.st_size)
        except OSError:
            token = ("unreadable", str(entry.path))
        _report_once(token, f"{self.what} entry {entry.path} is unreadable ({entry.problem}); "
                            f"it is ignored: {self.ignored}")

    def read(self, name: str) -> dict[str, Any] | None:
        """The record called ``name``; None when there is none, or when its file is
        unusable (reported once, see the module docstring). Never raises OSError."""
        entry = self._load(self.path(name))
        if entry is None:
            return None
        if entry.problem is not None:
            self._report_unreadable(entry)
            return None
        return entry.record

    def write(self, name: str, record: dict[str, Any]) -> Path | None:
        """Store ``record`` as ``name`` atomically; its path, or None when the folder
        is not writable (then it is kept in memory, with one warning per folder)."""
        path = self.path(name)
        text = json.dumps(record, indent=2, sort_keys=True)
        try:
            write_atomically(path, text.encode("utf-8"))
        except OSError as exc:
            with self._lock:
                self._memory[path] = text
                self._memory.move_to_end(path)
                while len(self._memory) > MEMORY_LIMIT:
                    self._memory.popitem(last=False)
            _report_once(
                ("unwritable", self.what, str(path.parent)),
                f"{self.what} directory {path.parent} is not writable ({exc}); {self.holds} "
                "are kept in memory only, for this process (set ATTN_BACKENDS_CACHE_DIR)",
            )
            return None
        with self._lock:
            self._memory.pop(path, None)
        return path

    def entries(self) -> list[Entry]:
        """Every record of the folder (and those kept in memory), in file-name
        order; an unusable one has ``record`` None and its ``problem``. Nothing
        is reported here: the caller shows the problems."""
        base = self.folder()
        paths = set(base.glob("*.json")) if base.is_dir() else set()
        with self._lock:
            paths.update(p for p in self._memory if p.parent == base)
        found = (self._load(path) for path in sorted(paths))
        return [entry for entry in found if entry is not None]

    def remove(self, path: Path) -> bool:
        """Forget the record in ``path`` (file and memory); whether there was one."""
        with self._lock:
            removed = self._memory.pop(path, None) is not None
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return removed
        return True
