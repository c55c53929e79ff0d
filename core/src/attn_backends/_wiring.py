"""The public :class:`Registry`: the choosing layer's registry wired to the layers
above it, and the process-wide ``registry``.

Selection cannot import the prober or the parallel layer (they sit above it), so
they are handed to it here, each loaded on first use: ``import attn_backends``
loads neither (docs/DESIGN.md, "Core's layers").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .choose import registry as choosing
from .choose.registry import Lazy
from .choose.select import Agree, Probe, Tuning

if TYPE_CHECKING:
    from .choose.attention import ParallelLayer


def core_prober() -> Probe:
    """Core's prober (float64 oracle, verdicts cached on disk), built on first use."""
    from .probe.prober import Prober

    return Prober()


def table_reader() -> Tuning:
    """Core's tuning-table reader (tables cached per file and version), built on first use."""
    from .probe.tuning import TableReader

    return TableReader()


def host_agreement() -> Agree:
    """Core's agreement across the processes of a multi-process run, built on
    first use (only when ``jax.process_count() > 1``)."""
    from .parallel.hosts import Hosts

    return Hosts()


def parallel_layer() -> ParallelLayer:
    """``attn_backends.parallel``, imported when a call first needs it."""
    from . import parallel

    return parallel


class Registry(choosing.Registry):
    """Installed backends, loaded lazily, and the entry point for selection.

    ``plugins`` are in-process plugin objects (modules or instances holding
    ``@hookimpl`` functions), registered besides the entry points. Settings
    left as None come from the ``ATTN_BACKENDS_*`` environment variables when
    discovery runs. ``probe`` is "auto" (compare each backend with core's
    float64 oracle once per verdict key, cached on disk: docs/DESIGN.md,
    "Probes"), None (no probes) or a callable
    ``probe(backend, call, platform, options) -> reasons``. Sharded inputs and
    ``get(mesh=, spec=, sequence_axis=)`` are served by the parallel layer. In a
    multi-process run every process agrees on each choice
    (:class:`attn_backends.parallel.hosts.Hosts`; docs/MANY_CHIPS.md, "Many hosts")
    but local work, which each chooses alone (``attn_backends.local_work()``).
    """

    def __init__(
        self,
        *,
        plugins: Sequence[object] = (),
        autoload: bool | None = None,
        strict: bool | None = None,
        only: Sequence[str] | None = None,
        disable: Sequence[str] | None = None,
        probe: Probe | None | str = "auto",
    ):
        if isinstance(probe, str):
            if probe != "auto":
                raise ValueError(
                    f"probe: expected 'auto', None or a callable "
                    f"probe(backend, call, platform, options), got {probe!r}"
                )
            probe = Lazy(core_prober)
        super().__init__(plugins=plugins, autoload=autoload, strict=strict, only=only,
                         disable=disable, probe=probe, parallel=parallel_layer,
                         tuning=Lazy(table_reader), agree=Lazy(host_agreement))


#: The process-wide registry: ``attn_backends.registry.get(device="tpu")``.
registry = Registry()
