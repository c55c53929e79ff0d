"""What this process runs on: ``device=`` as a platform name, the platforms JAX
sees, where a value lives (its sharding, the manual axes it varies over), the
software and hardware a verdict (probe, certificate) is valid for, and the
``ATTN_BACKENDS_*`` settings."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import jax

from .errors import PlatformUnavailableError

T = TypeVar("T")

#: The platforms core knows by name, JAX's own. A manifest may name any other
#: (:func:`check_platform`); tolerance rows exist for these three, and another
#: platform gets the default rows.
PLATFORMS = frozenset({"cpu", "gpu", "tpu"})
#: Platform names as JAX spells them -> the contract's names: the one place
#: names are normalised. A name not here is its own contract name ("cpu",
#: "tpu", a PJRT plugin's "neuron").
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
#: The contract's platform names -> the lowering platforms JAX names them by
#: (``jax.export(platforms=...)``, ``jax.lax.platform_dependent``); a platform
#: not here lowers by its own name (:func:`lowering_names`).
LOWERING_NAMES = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}
#: A platform name: a lowercase identifier, as JAX and PJRT plugins name platforms.
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_WHAT_NAMES = (
    "a platform is cpu, gpu, tpu or the name a JAX PJRT plugin reports (e.g. 'neuron'): "
    "a lowercase identifier"
)


def platform_name(name: str) -> str:
    """The contract's name for a platform JAX calls ``name``: "cuda" and "rocm"
    are "gpu"; any other name is itself (case-insensitive)."""
    name = name.lower()
    return _ALIASES.get(name, name)


def lowering_names(platform: str) -> tuple[str, ...]:
    """The lowering platforms JAX names the contract's ``platform`` by."""
    return LOWERING_NAMES.get(platform, (platform,))


def check_platform(name: Any, what: str) -> str:
    """``name`` if it is a contract platform name, else ValueError starting with ``what``.

    Valid: a lowercase identifier (``[a-z][a-z0-9_]*``) that is not one of
    JAX's aliases ("cuda", "rocm": the contract says "gpu") and not a near
    miss of cpu, gpu or tpu ("gpuu", "cpus": typos, not plugins). Any other
    such name is a platform a PJRT plugin may report.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what}: {name!r} is not a platform name; {_WHAT_NAMES}")
    if name in _ALIASES:
        raise ValueError(
            f"{what}: {name!r} is JAX's name for the contract's {_ALIASES[name]!r}; "
            f"write {_ALIASES[name]!r}"
        )
    if name not in PLATFORMS:
        import difflib

        close = difflib.get_close_matches(name, sorted(PLATFORMS), n=1, cutoff=0.8)
        if close:
            raise ValueError(
                f"{what}: {name!r} is not a platform name; did you mean {close[0]!r}? "
                f"({_WHAT_NAMES})"
            )
    return name


@functools.cache
def visible_platforms() -> tuple[str, ...]:
    """The platforms JAX has a backend for in this process, by the contract's
    names, sorted: cpu, gpu, tpu and any a PJRT plugin adds.

    Read from ``jax.extend.backend.backends()`` (JAX's table of initialised
    backends, plugins' included), named through :func:`platform_name`.
    """
    from . import jax_api

    return tuple(sorted({platform_name(name) for name in jax_api.initialised_backends()}))


def resolve(device: Any) -> tuple[str, bool]:
    """``device`` (None, a platform name such as "cpu", "gpu", "cuda" or a
    plugin's "neuron", or a jax.Device) -> (platform, present).

    ``present`` says whether JAX can run on that platform here; cpu, gpu and
    tpu still select when absent (by manifest alone) for ``jax.export``.
    Another platform JAX does not report raises PlatformUnavailableError: it
    exists only through its plugin, which is not installed (or found no device).
    """
    if device is None:
        return platform_name(jax.default_backend()), True
    if isinstance(device, jax.Device):
        return platform_name(device.platform), True
    if not isinstance(device, str):
        raise ValueError(
            "device: expected None, a platform name (cpu, gpu, tpu, or a JAX plugin's "
            f"such as 'neuron') or a jax.Device, got {device!r}"
        )
    platform = check_platform(platform_name(device), "device")
    visible = visible_platforms()
    if platform not in PLATFORMS and platform not in visible:
        raise PlatformUnavailableError(
            f"device={device!r}: JAX reports no {platform!r} platform here (JAX reports: "
            f"{', '.join(visible) or 'none'}). A platform other than cpu, gpu and tpu comes "
            f"from a JAX PJRT plugin: install the plugin package that provides {platform!r} "
            f"(its vendor names it), then check that jax.devices({platform!r}) lists its "
            "devices."
        )
    return platform, platform in visible


def resolve_all(device: Any) -> tuple[tuple[str, bool], ...]:
    """:func:`resolve` for ``device`` or for each entry of a list or tuple of them
    (a program exported for several platforms), duplicates dropped."""
    if not isinstance(device, (list, tuple)):
        return (resolve(device),)
    if not device:
        raise ValueError("device: an empty list names no platform; pass None for JAX's default")
    resolved = dict(resolve(d) for d in device)
    return tuple(resolved.items())


def expected(accepts: str, got: str) -> str:
    """How a setting's error says what it takes and what it was given:
    ``expected ACCEPTS, got 'GOT'`` (after the setting's name)."""
    return f"expected {accepts}, got {got!r}"


def env_setting(name: str, parse: Callable[[str], T], *, accepts: str, default: T) -> T:
    """The environment variable ``name``, read by ``parse``; ``default`` when it
    is unset or blank.

    Every ``ATTN_BACKENDS_*`` variable is read here. ``parse`` is given the
    value without surrounding whitespace and raises ValueError for one it does
    not take; the ValueError raised then names the variable, what it read and
    ``accepts`` (what it takes): ``NAME: expected ACCEPTS, got 'VALUE'``.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return parse(raw.strip())
    except ValueError:
        raise ValueError(f"{name}: {expected(accepts, raw)}") from None


_FLAG_WORDS = {"0": False, "false": False, "no": False, "off": False,
               "1": True, "true": True, "yes": True, "on": True}


def seconds(text: str) -> float:
    """A duration setting: a finite number > 0 (``float`` raises ValueError for what
    is not a number); :func:`env_setting`'s ``parse`` for ``*_S`` variables."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    try:
        return _FLAG_WORDS[text.lower()]
    except KeyError:
        raise ValueError(text) from None


def env_flag(var: str) -> bool:
    """The on/off environment variable ``var``: unset, 0/false/no/off (off) or
    1/true/yes/on (on), any case; anything else raises ValueError naming it."""
    return env_setting(var, _flag, accepts="1/0 (or true/false, yes/no, on/off)", default=False)


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def versions() -> dict[str, str | None]:
    """attn-backends, jax, jaxlib and libtpu versions (None when not installed)."""
    return {
        "attn_backends": _installed("attn-backends"),
        "jax": _installed("jax"),
        "jaxlib": _installed("jaxlib"),
        "libtpu": _installed("libtpu") or _installed("libtpu-nightly"),
    }


def local_device(platform: str) -> Any:
    """This process's first device of ``platform``: where probes and certificates run.

    In a multi-process run (``jax.distributed``) ``jax.devices(platform)[0]`` is
    process 0's device, which no other process can read back from; every process
    judges a backend on a device of its own (docs/MANY_CHIPS.md, "Many hosts").
    """
    return jax.local_devices(backend=platform)[0]


def process_count() -> int:
    """How many JAX processes this run has (``jax.distributed``; 1 on one host).
    Only above 1 does selection agree across processes."""
    return jax.process_count()


# In jit's cache key (and its trace context): a function traced inside
# local_work() and again outside it is traced twice, so a local choice is never
# replayed in a program every process runs (nor the reverse).
_marked = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def local_work() -> Iterator[None]:
    """Mark the attention calls made or traced inside as this process's own work,
    selected without the other processes (no agreement, no waiting for them).

    For code only some processes run, e.g. under ``if jax.process_index() == 0:``,
    on this process's devices. A marked call that JAX knows spans processes
    raises UnsupportedError; paged attention got inside is local for its lifetime.
    """
    with _marked(True):
        yield


def marked() -> bool:
    """Whether calls made here are inside :func:`local_work`."""
    return bool(_marked.value)


def sharding_of(x: Any) -> Any:
    """The sharding of a concrete array, ShapeDtypeStruct or (under jit) tracer, or None."""
    # Imported here: `import attn_backends` loads this module, not jax_api.
    from . import jax_api

    if isinstance(x, jax.core.Tracer):
        try:
            return jax_api.aval_of(x).sharding
        except Exception:  # noqa: BLE001 - an aval without sharding: nothing to learn
            return None
    return getattr(x, "sharding", None)


def is_sharded(x: Any) -> bool:
    """Whether ``x`` is laid out over mesh axes (a spec naming one, or a sharding that
    is neither single-device nor fully replicated): such a call is the parallel layer's."""
    from . import jax_api

    sharding = sharding_of(x)
    if sharding is None or jax_api.is_single_device_sharding(sharding):
        return False
    if isinstance(sharding, jax.sharding.NamedSharding):
        return not sharding.mesh.empty and any(entry is not None for entry in sharding.spec)
    return not getattr(sharding, "is_fully_replicated", False)


def varying_axes(*values: Any) -> frozenset[str]:
    """The manual mesh axes (inside ``jax.shard_map``) any array in ``values``
    (pytrees) varies over; empty outside shard_map."""
    from . import jax_api

    axes: frozenset[str] = frozenset()
    for x in jax.tree.leaves(values):
        manual = getattr(jax_api.aval_of(x), "manual_axis_type", None)
        if manual is not None:
            axes |= manual.varying
    return axes


def vary_like(tree: Any, *like: Any) -> Any:
    """``tree``'s arrays typed as varying over every manual axis ``like`` varies over.

    Inside a ``jax.shard_map`` with ``check_vma=True`` a value made from constants
    (``jnp.zeros``, a loop carry's start) is invariant, and JAX refuses a loop whose
    carry, or a switch whose branches, mix it with one made from the varying
    inputs. ``jax.lax.pcast(..., to="varying")`` moves no data; outside shard_map
    this returns ``tree`` unchanged.
    """
    axes = varying_axes(like)
    if not axes:
        return tree

    from . import jax_api

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax_api.cast_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def device_kind(platform: str) -> str | None:
    """This process's device kind on ``platform``, or None when the platform is absent."""

    if platform not in visible_platforms():
        return None
    return str(local_device(platform).device_kind)


def _absolute_path(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise ValueError(text)  # relative to the working directory: each process its own cache
    return path


def cache_dir() -> Path:
    """``$ATTN_BACKENDS_CACHE_DIR`` (an absolute path; ``~`` is expanded), else
    ``$XDG_CACHE_HOME/attn-backends`` or ``~/.cache/attn-backends``."""
    explicit = env_setting("ATTN_BACKENDS_CACHE_DIR", _absolute_path,
                           accepts="an absolute directory path (~ allowed)", default=None)
    if explicit is not None:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn-backends"


#: The tuning table's file name in the cache folder (``attn-backends tune``'s
#: default ``--out``), read when neither ``tuning=`` nor ``ATTN_BACKENDS_TUNING``
#: names one.
TABLE_NAME = "tuning.json"


def tuning_table(given: str | os.PathLike[str] | None) -> Path | None:
    """The tuning table selection reads: ``given``, else ``ATTN_BACKENDS_TUNING``,
    else the cache folder's :data:`TABLE_NAME` when it exists, else None."""
    if given is not None:
        return Path(given)
    named = env_setting("ATTN_BACKENDS_TUNING", lambda text: Path(text).expanduser(),
                        accepts="the path of a tuning table (attn-backends tune --out)",
                        default=None)
    if named is not None:
        return named
    cached = cache_dir() / TABLE_NAME
    return cached if cached.is_file() else None
