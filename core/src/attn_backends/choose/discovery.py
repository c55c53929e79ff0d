"""Finding backends: entry points and in-process plugins, each loaded in isolation.

A plugin that fails to import, fails in its hook, returns something that is
not a Backend, or declares an unsupported api_version is skipped with a
:class:`PluginWarning` naming its distribution and version (strict mode
raises :class:`PluginError`). Allow/deny lists apply to entry-point names
before anything is imported.
"""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from ..contract.backend import ENTRY_POINT_GROUP, PROJECT, Backend, HookSpecs, Seams
from ..contract.call import SUPPORTED_API_VERSIONS
from ..contract.capabilities import Capabilities
from ..contract.environment import env_flag, env_setting
from ..contract.errors import PluginConflictError, PluginError, PluginWarning, warn
from .select import jax_range_reason

logger = logging.getLogger("attn_backends")

IN_PROCESS = "<in-process>"


@dataclass(frozen=True)
class Origin:
    """Where a plugin came from: its entry point (or object) and distribution."""

    plugin: str
    distribution: str
    version: str

    def describe(self) -> str:
        if self.distribution == IN_PROCESS:
            return f"in-process plugin {self.plugin!r}"
        return f"plugin {self.plugin!r} from {self.distribution} {self.version}"


@dataclass(frozen=True)
class LoadProblem:
    """A plugin or backend that was skipped or flagged, and why."""

    origin: Origin
    message: str

    def __str__(self) -> str:
        return f"{self.origin.describe()}: {self.message}"


@dataclass
class Discovered:
    """Result of discovery: backends by name, their origins, and the problems."""

    backends: dict[str, Backend] = field(default_factory=dict)
    origins: dict[str, Origin] = field(default_factory=dict)
    problems: list[LoadProblem] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    """Discovery settings; :meth:`from_env` reads the ``ATTN_BACKENDS_*`` variables."""

    autoload: bool = True
    strict: bool = False
    only: frozenset[str] | None = None
    disable: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Settings from the environment; ``overrides`` that are not None win, and
        the variable of a setting overridden is not read."""
        readers = {
            "autoload": lambda: not env_flag("ATTN_BACKENDS_NO_AUTOLOAD"),
            "strict": lambda: env_flag("ATTN_BACKENDS_STRICT"),
            "only": lambda: _names("ATTN_BACKENDS_ONLY", None),  # unset or empty: no list
            "disable": lambda: _names("ATTN_BACKENDS_DISABLE", frozenset()),
        }
        env = {k: read() for k, read in readers.items() if overrides.get(k) is None}
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)

    def allows(self, name: str) -> bool:
        return name not in self.disable and (self.only is None or name in self.only)


#: An entry-point name as packaging recommends it: letters, digits, ``_``, ``.``, ``-``.
_NAME = re.compile(r"[\w.-]+")


def _parse_names(text: str) -> frozenset[str]:
    names = [n.strip() for n in text.split(",")]
    if not any(names) or not all(_NAME.fullmatch(n) for n in names if n):
        raise ValueError(text)
    return frozenset(n for n in names if n)


def _names(var: str, default: frozenset[str] | None) -> frozenset[str] | None:
    """A comma-separated list of backend (entry-point) names; ``default`` when unset or empty."""
    return env_setting(var, _parse_names, default=default,
                       accepts="comma-separated backend names like reference,xla_native")


def _entry_points() -> list[tuple[metadata.EntryPoint, Origin]]:
    """Entry points of the group with their origin, one per (distribution, name), in a
    stable order."""
    seen: dict[tuple[str, str], tuple[metadata.EntryPoint, Origin]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        # Each ``dist.name`` / ``dist.version`` reads the METADATA file again: once here.
        dist, version = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("?", "?")
        # The same distribution reachable twice on sys.path registers once.
        seen.setdefault((_normalise(dist), ep.name), (ep, Origin(ep.name, dist, version)))
    return [seen[key] for key in sorted(seen)]


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


#: Modules a plugin must not patch at import; checked by identity of attributes.
GUARDED_MODULES = ("jax", "jax.numpy", "jax.lax", "jax.nn", "attn_backends")


def _snapshot() -> tuple[dict[str, Any], dict[str, int]]:
    """jax.config values, and the identity of every attribute of the guarded modules.

    Submodules are left out: importing ``jax.experimental.pallas`` legitimately
    adds ``jax.experimental`` to ``jax``.
    """
    import importlib

    import jax

    ids = {}
    for name in GUARDED_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if not (isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{attr}"):
                ids[f"{name}.{attr}"] = id(value)
    return dict(jax.config.values), ids


def _changes(
    before: tuple[dict[str, Any], dict[str, int]], after: tuple[dict[str, Any], dict[str, int]]
) -> list[str]:
    """What a plugin import changed: config values, replaced or added module attributes."""
    (config_before, ids_before), (config_after, ids_after) = before, after
    changes = [
        f"jax.config {key}: {config_before.get(key)!r} -> {config_after.get(key)!r}"
        for key in sorted(set(config_before) | set(config_after))
        if config_before.get(key) != config_after.get(key)
    ]
    for attr in sorted(set(ids_before) | set(ids_after)):
        if attr not in ids_before:
            changes.append(f"added {attr}")
        elif ids_after.get(attr) != ids_before[attr]:
            changes.append(f"replaced {attr}")
    return changes


class Loader:
    """Runs discovery once; collects backends and problems."""

    def __init__(self, settings: Settings, jax_version: str):
        self.settings = settings
        self.jax_version = jax_version
        self.result = Discovered()
        self._claims: dict[str, list[tuple[Origin, Backend]]] = {}
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(HookSpecs)
        self._pm.add_hookspecs(Seams)  # a plugin may implement both (the registry's Features)

    def problem(self, origin: Origin, message: str) -> None:
        problem = LoadProblem(origin, message)
        if self.settings.strict:
            raise PluginError(f"{problem} (strict mode: ATTN_BACKENDS_STRICT)")
        self.result.problems.append(problem)
        warn(str(problem), PluginWarning)

    def load_entry_points(self) -> None:
        for ep, origin in _entry_points():
            if not self.settings.allows(ep.name):
                continue
            before = _snapshot()
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - reported, other plugins still load
                self.problem(origin, f"failed to import {ep.value!r}: {type(exc).__name__}: {exc}")
                continue
            changes = _changes(before, _snapshot())
            if changes:
                self.problem(origin, "changed global state at import: " + "; ".join(changes))
            self.register(module, origin)

    def register(self, plugin: object, origin: Origin) -> None:
        try:
            self._pm.register(plugin, name=f"{origin.distribution}:{origin.plugin}")
        except (pluggy.PluginValidationError, ValueError) as exc:
            self.problem(origin, f"is not a valid plugin: {exc}")
            return
        # As pluggy's check_pending(), per plugin: a marked implementation of
        # a hook core does not define (a misspelt name) would never be called.
        unknown = sorted(caller.name for caller in self._pm.get_hookcallers(plugin) or []
                         if not caller.has_spec())
        if unknown:
            self._pm.unregister(plugin)
            self.problem(
                origin,
                f"implements unknown hook(s) {', '.join(unknown)}; core defines only "
                "attn_backends_register and the seams of contract/backend.py (check the "
                "spelling): not registered",
            )
            return
        impls = [
            impl
            for impl in self._pm.hook.attn_backends_register.get_hookimpls()
            if impl.plugin is plugin
        ]
        seams = [c for c in self._pm.get_hookcallers(plugin) or []
                 if c.name != "attn_backends_register"]
        if not impls and not seams:
            self.problem(
                origin,
                "defines no attn_backends_register() marked with @attn_backends.hookimpl: "
                "it registers no backend",
            )
        for impl in impls:
            try:
                returned = impl.function()
            except Exception as exc:  # noqa: BLE001 - reported, other plugins still load
                self.problem(
                    origin, f"attn_backends_register() raised {type(exc).__name__}: {exc}"
                )
                continue
            self._accept(returned, origin)

    def _accept(self, returned: Any, origin: Origin) -> None:
        if not isinstance(returned, (list, tuple)):
            self.problem(
                origin,
                f"attn_backends_register() must return a list of Backend, "
                f"got {type(returned).__name__}",
            )
            return
        for item in returned:
            try:
                reason = self._invalid(item)
            except Exception as exc:  # noqa: BLE001 - reported, other backends still load
                reason = (f"backend {type(item).__name__}: reading its manifest raised "
                          f"{type(exc).__name__}: {exc}")
            if reason:
                self.problem(origin, reason)
            elif self.settings.allows(item.name):
                self._claims.setdefault(item.name, []).append((origin, item))

    def _invalid(self, item: Any) -> str | None:
        if not isinstance(item, Backend):
            return f"returned {type(item).__name__}, expected an attn_backends.Backend instance"
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            return f"backend {type(item).__name__} has no name"
        if getattr(item, "api_version", None) not in SUPPORTED_API_VERSIONS:
            return (
                f"backend {name!r} implements api_version {getattr(item, 'api_version', None)}, "
                f"core supports {sorted(SUPPORTED_API_VERSIONS)}: not registered"
            )
        if not isinstance(getattr(item, "capabilities", None), Capabilities):
            return f"backend {name!r} has no Capabilities manifest"
        if not isinstance(getattr(item, "version", None), str):
            return f"backend {name!r} has no version string (set the class attribute version)"
        priority = getattr(item, "priority", None)
        if not isinstance(priority, Mapping) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in priority.values()
        ):
            return f"backend {name!r}: priority must map platform names to ints, got {priority!r}"
        if jax_range_reason(item, self.jax_version):
            # Registered (explain and `attn-backends list` show it refused, with the
            # reason). A warning at every load would reach users who never asked
            # for it (a plugin installed beside others for another jax line), so
            # it warns only when ATTN_BACKENDS_ONLY names it, and is logged otherwise.
            message = (f"backend {name!r} supports jax {item.capabilities.jax_versions}, but "
                       f"jax {self.jax_version} is installed: it will not be selected")
            if self.settings.only is not None and name in self.settings.only:
                warn(message, PluginWarning)
            else:
                logger.info(message)
        return None

    def finish(self) -> Discovered:
        for name, claims in sorted(self._claims.items()):
            origins = sorted(
                {origin for origin, _ in claims}, key=lambda o: (o.distribution, o.plugin)
            )
            if len(claims) > 1:
                distributions = sorted({o.distribution for o in origins})
                who = (
                    f"several distributions: {', '.join(distributions)}"
                    if len(distributions) > 1
                    else "several plugins: " + ", ".join(o.describe() for o in origins)
                )
                raise PluginConflictError(
                    f"backend name {name!r} is registered by {who}. Uninstall one, or "
                    "disable one with ATTN_BACKENDS_DISABLE / ATTN_BACKENDS_ONLY."
                )
            origin, backend = claims[0]
            self.result.backends[name] = backend
            self.result.origins[name] = origin
        return self.result


def discover(
    settings: Settings,
    jax_version: str,
    plugins: Sequence[object] = (),
) -> Discovered:
    """Load entry points (if autoload) and the given in-process plugins."""
    loader = Loader(settings, jax_version)
    if settings.autoload:
        loader.load_entry_points()
    for plugin in plugins:
        name = getattr(plugin, "__name__", repr(plugin))
        loader.register(plugin, Origin(name, IN_PROCESS, ""))
    return loader.finish()
