"""The plugin API: the base class every backend subclasses; the pluggy hook
specifications, with their markers: the one a backend plugin implements
(:class:`HookSpecs`) and core's seams (:class:`Seams`); and the seams' manager.

Core's seams are the hooks through which judging, tuning tables, the parallel
layer and many-host agreement attach to selection (docs/DESIGN.md, "Core's
layers"). The choosing layer imports none of them: it calls these hooks, and the
features answer as plugins, as pytest's own features are plugins on its
hookspecs. Core's (:data:`CORE_PLUGINS`) are registered like a third party's
(``Registry(plugins=[obj])``, an object or module with ``@attn_backends.hookimpl``
functions), marked ``trylast`` so a third party's answer comes first, and
blockable (``Registry(block=["tuning"])``). Each core plugin is imported on the
first call of one of its hooks, never before: a call on one device imports no
parallel code, a run without a tuning table no table reader. Every seam is
``firstresult``: the first implementation that returns something other than
None answers."""

from __future__ import annotations

import abc
import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pluggy

from .call import AttentionCall, Operands
from .capabilities import Capabilities
from .errors import UnsupportedError


class Backend(abc.ABC):
    """One attention implementation offered by a plugin.

    Subclasses set the class attributes and implement :meth:`attend`:

    - ``name``: unique backend name (the entry-point name by convention);
    - ``version``: the distribution version;
    - ``api_version``: contract version implemented (core supports 1);
    - ``capabilities``: the static :class:`Capabilities` manifest;
    - ``priority``: default priority per platform (higher wins).

    Backends must import their heavy kernel modules lazily (inside
    :meth:`attend`), so listing backends never compiles or runs a kernel.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    api_version: ClassVar[int] = 1
    capabilities: ClassVar[Capabilities]
    priority: ClassVar[Mapping[str, int]] = {}
    #: Name of the op the backend's own kernel leaves in the lowered program
    #: (e.g. ``"tpu_custom_call"``); the conformance suite checks for it.
    hlo_marker: ClassVar[str | None] = None

    def check(self, call: AttentionCall) -> list[str]:
        """Reasons this backend cannot serve ``call`` beyond its manifest; empty if it can."""
        return []

    @abc.abstractmethod
    def attend(
        self,
        call: AttentionCall,
        q: Any,
        k: Any,
        v: Any,
        operands: Operands,
        options: Any = None,
    ) -> Any:
        """Compute attention for a validated call.

        q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``.
        Returns out ``[B, Tq, Hq, Dv]`` (dtype of q), or ``(out, lse)`` with lse
        ``[B, Hq, Tq]`` float32 when ``call.return_lse``. ``options`` is what the
        user passed for this backend through ``registry.get(backend_options=...)``.
        Raise :class:`UnsupportedError` for anything the backend cannot do.
        """

    def tile_small_options(self, call: AttentionCall) -> Any:
        """Options (as passed to :meth:`attend`) that cut ``call`` into the smallest
        tiles the backend allows, or None when it does not tile.

        The runtime probe and the conformance suite also run each call under
        these, so a few dozen tokens cross several tiles and the bugs that live
        between tiles (a lost online-softmax rescale, an accumulator overwritten
        instead of summed, an off-by-one at a tile edge) show on small inputs.
        Optional: added within api_version 1, defaults to None.
        """
        return None

    def dropout_keep(self, call: AttentionCall, key: Any) -> Any:
        """The keep-mask :meth:`attend` applies to ``call`` with ``dropout_key=key``:
        bool ``[B, Hq, Tq, Tk]``, True where the weight of key j for query i is kept
        (then scaled by ``1 / (1 - call.dropout_rate)``).

        Exactly the mask ``attend`` draws, forward and backward, whatever the
        options (block sizes) it runs with: the probe and the conformance suite
        compare ``attend`` with the float64 oracle under it. Called for small
        calls only (it may materialise the mask); ``key`` as in
        :class:`Operands`. A backend whose manifest claims ``dropout`` must
        implement it. Added within api_version 1.
        """
        raise UnsupportedError(
            f"backend {self.name!r} does not expose its dropout keep-mask "
            "(Backend.dropout_keep), so its dropout cannot be checked"
        )

    def priority_on(self, platform: str) -> int:
        """This backend's default priority on ``platform`` (0 when undeclared)."""
        return int(self.priority.get(platform, 0))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.version}>"


PROJECT = "attn_backends"
#: Entry-point group plugins register under.
ENTRY_POINT_GROUP = "attn_backends"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Marker for plugin hook implementations: ``@attn_backends.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """Hooks a plugin module may implement."""

    @hookspec
    def attn_backends_register(self) -> list:  # type: ignore[type-arg]
        """Return the plugin's :class:`attn_backends.Backend` instances.

        Must not compile or run a kernel: it is called while listing backends.
        """
        raise NotImplementedError


class Seams:
    """The hooks core calls; each docstring is the contract of its answer."""

    @hookspec(firstresult=True)
    def attn_backends_probe(self, backend: Any, call: Any, platform: str,
                            options: Any) -> list[str] | None:
        """The reasons ``backend`` fails the dense ``call`` on ``platform`` under the
        caller's ``options`` for it (empty: it passes; None: nothing was compared).
        Core's: :class:`attn_backends.probe.prober.Prober` (float64 oracle, verdicts
        on disk)."""

    @hookspec(firstresult=True)
    def attn_backends_probe_paged(self, backend: Any, call: Any, platform: str,
                                  options: Any) -> list[str] | None:
        """As :meth:`attn_backends_probe`, for a paged ``call`` (a ``PagedCall``)."""

    @hookspec(firstresult=True)
    def attn_backends_measured(self, table: Any, call: Any, platform: str, grad: bool,
                               backends: Any) -> Any:
        """What the tuning table at ``table`` (a path) says of ``call`` on
        ``platform``, timed with its backward pass when ``grad``: a
        :class:`~attn_backends.choose.select.Measured`. Reads a file, never times.
        Asked only when a table exists (``contract.environment.tuning_table``).
        Core's: :class:`attn_backends.probe.tuning.TableReader`."""

    @hookspec(firstresult=True)
    def attn_backends_agree(self, explanation: Any, question: Any, rejudge: Any) -> Any:
        """The :class:`~attn_backends.Explanation` every process of a multi-process
        run agrees on for ``question`` (a hashable naming the same selection in
        every process), given this process's ``explanation`` and
        ``rejudge(probe_also)`` to probe a backend it deferred. Asked only when
        ``jax.process_count() > 1``. Core's: :class:`attn_backends.parallel.hosts.Hosts`."""

    @hookspec(firstresult=True)
    def attn_backends_sharding_request(self, mesh: Any, spec: Any, sequence_axis: str | None,
                                       ring_block: int | None) -> Any:
        """``registry.get(mesh=, spec=, sequence_axis=, ring_block=)`` checked, as the
        request handed back to the two hooks below. Core's: ``attn_backends.parallel``."""

    @hookspec(firstresult=True)
    def attn_backends_sharded_call(self, selection: Any, request: Any, call: Any, q: Any,
                                   k: Any, v: Any, operands: Any) -> Any:
        """The result of ``call`` whose inputs (or ``request``) lay it out on a mesh;
        ``selection`` is the single-device
        :class:`~attn_backends.choose.attention.SingleDevice` it chooses backends with."""

    @hookspec(firstresult=True)
    def attn_backends_sharded_explain(self, selection: Any, request: Any, call: Any, q: Any,
                                      k: Any, v: Any) -> Any:
        """Every backend's verdict for ``call`` as laid out on the mesh (an Explanation)."""


@dataclass(frozen=True)
class CorePlugin:
    """One of core's own plugins: ``target`` is ``"module"`` (module-level
    hookimpls) or ``"module:Class"`` (an instance per registry)."""

    name: str
    target: str
    hooks: tuple[str, ...]


#: Core's plugins, by name, as pytest's ``default_plugins``: imported by name on
#: the first call of one of their hooks.
CORE_PLUGINS = (
    CorePlugin("probe", "attn_backends.probe.prober:Prober",
               ("attn_backends_probe", "attn_backends_probe_paged")),
    CorePlugin("tuning", "attn_backends.probe.tuning:TableReader", ("attn_backends_measured",)),
    CorePlugin("hosts", "attn_backends.parallel.hosts:Hosts", ("attn_backends_agree",)),
    CorePlugin("parallel", "attn_backends.parallel",
               ("attn_backends_sharding_request", "attn_backends_sharded_call",
                "attn_backends_sharded_explain")),
)


class Features:
    """One registry's plugin manager for the seams: core's plugins, loaded on
    first use unless blocked, and the ones given to it."""

    def __init__(self, plugins: Sequence[object] = (), block: Sequence[str] = ()):
        known = {p.name for p in CORE_PLUGINS}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f"block: {unknown} are not core plugins; core's are {sorted(known)}")
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(Seams)
        self._blocked = set(block)
        self._tried: set[str] = set()
        self._callers: dict[str, Callable[..., Any] | None] = {}
        self._lock = threading.RLock()
        for plugin in plugins:
            if implements_a_seam(plugin):
                self._pm.register(plugin)

    def hook(self, name: str) -> Callable[..., Any] | None:
        """Hook ``name`` as a function of its arguments in the spec's order (core's
        plugins for it loaded), or None when nothing implements it. Kept per name
        until a plugin is registered or replaced: selection asks on every new call."""
        try:
            return self._callers[name]
        except KeyError:
            pass
        for core in CORE_PLUGINS:
            if name in core.hooks:
                self._load(core)
        caller = getattr(self._pm.hook, name)
        names = caller.spec.argnames

        def call(*args: Any) -> Any:
            return caller(**dict(zip(names, args, strict=True)))

        self._callers[name] = call if caller.get_hookimpls() else None
        return self._callers[name]

    def register(self, plugin: object) -> None:
        """Register a third party's plugin object on the seams."""
        with self._lock:
            self._pm.register(plugin)
            self._callers.clear()

    def plugin(self, name: str) -> Any:
        """The plugin registered as ``name`` (a core plugin is loaded first), or None."""
        for core in CORE_PLUGINS:
            if core.name == name:
                self._load(core)
        return self._pm.get_plugin(name)

    def replace(self, name: str, plugin: object | None) -> None:
        """Put ``plugin`` where the one called ``name`` was (None: block it)."""
        with self._lock:
            self._tried.add(name)
            if self._pm.get_plugin(name) is not None:
                self._pm.unregister(name=name)
            self._blocked.discard(name)
            if plugin is None:
                self._blocked.add(name)
            else:
                self._pm.register(plugin, name=name)
            self._callers.clear()

    def _load(self, core: CorePlugin) -> None:
        with self._lock:
            if core.name in self._tried or core.name in self._blocked:
                return
            self._tried.add(core.name)
            module, _, factory = core.target.partition(":")
            loaded = importlib.import_module(module)
            self._pm.register(getattr(loaded, factory)() if factory else loaded, name=core.name)
            self._callers.clear()


def implements_a_seam(plugin: object) -> bool:
    """Whether ``plugin`` holds an ``@hookimpl`` of one of :class:`Seams`' hooks."""
    return any(callable(getattr(plugin, name, None)) for name in vars(Seams)
               if name.startswith("attn_backends_"))


class CallableProbe:
    """A probe given as a callable, ``probe(backend, call, platform, options) ->
    reasons``, as a plugin (dense calls only: :meth:`of`)."""

    def __init__(self, probe: Any):
        self.probe = probe

    @staticmethod
    def of(probe: Any) -> CallableProbe:
        """The plugin for ``probe``: one that also probes paged calls when the
        callable has a ``paged`` attribute (a probe without one judges none)."""
        return (CallablePagedProbe if callable(getattr(probe, "paged", None))
                else CallableProbe)(probe)

    @hookimpl(trylast=True)  # in core's probe's place: a third party's answer comes first
    def attn_backends_probe(self, backend: Any, call: Any, platform: str,
                            options: Any) -> list[str] | None:
        return self.probe(backend, call, platform, options)


class CallablePagedProbe(CallableProbe):
    """A callable probe with a ``paged`` attribute, for paged calls too."""

    @hookimpl(trylast=True)  # in core's probe's place: a third party's answer comes first
    def attn_backends_probe_paged(self, backend: Any, call: Any, platform: str,
                                  options: Any) -> list[str] | None:
        return self.probe.paged(backend, call, platform, options)
