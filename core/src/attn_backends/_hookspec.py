"""The pluggy hook specification plugins implement, and the markers."""

from __future__ import annotations

import pluggy

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
