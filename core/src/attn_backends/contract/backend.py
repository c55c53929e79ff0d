"""The plugin API: the base class every backend subclasses, and the pluggy hook
specification (with its markers) a plugin module implements."""

from __future__ import annotations

import abc
from collections.abc import Mapping
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
