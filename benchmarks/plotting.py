"""The benchmark scripts' figures: PNG files drawn by matplotlib (Agg) from the
numbers their run printed, with the machine and the date in the title.

A script records :func:`stamp` in its run's JSON, then draws with :func:`axes`
(a figure of panels titled with that stamp) and writes with :func:`save`;
:func:`progress` is the scripts' progress bar and :func:`note` a line beside it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def machine() -> str:
    """``"<CPU model>, <n> cores"`` of this machine (Linux's /proc/cpuinfo)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def stamp() -> dict[str, str]:
    """Where and when a run ran, for its JSON: ``{"machine": ..., "date": ...}`` (UTC);
    its figures are titled with these, wherever and whenever they are drawn."""
    return {"machine": machine(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def axes(panels: int, title: str, run: dict[str, str], *, width: float = 5.5,
         height: float = 4.2) -> tuple[Any, Any]:
    """(figure, a list of ``panels`` axes side by side) titled ``title``, then the
    run's machine and date (``run``: :func:`stamp`'s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    fig.suptitle(f"{title}\n{run['machine']}, {run['date']}", fontsize=10)
    return fig, list(ax[0])


def log_lengths(ax: Any, lengths: Sequence[int], label: str) -> None:
    """A log x axis ticked with exactly ``lengths`` (no 3x10^2 minor labels)."""
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(list(lengths), [str(n) for n in lengths])
    ax.set_xlabel(label)


def save(fig: Any, path: str | os.PathLike[str]) -> None:
    """Write ``fig`` as a PNG at ``path`` (folders made) and close it."""
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """``items`` with a progress bar on stderr (tqdm), none when stderr is not a
    terminal. While the bar shows, what the loop prints goes through tqdm's
    ``write``, so a table printed row by row and the bar stay whole."""
    from tqdm import tqdm
    from tqdm.contrib import DummyTqdmFile

    bar = tqdm(items, total=total, desc=desc, disable=None, file=sys.stderr)
    if bar.disable:
        yield from bar
        return
    with contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
        yield from bar


def note(text: str) -> None:
    """A line on stderr that leaves a progress bar whole (tqdm's ``write``)."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)
