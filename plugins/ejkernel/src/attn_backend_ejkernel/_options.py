"""The options ``ejkernel_xla`` runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EjkernelOptions:
    """ejkernel's chunk sizes (its ``FwdParams``): query and key rows per chunk.

    None: ejkernel's default, ``min(128, T)``. With a softcap ejkernel raises
    either below 16 to 16.
    """

    q_block: int | None = None
    kv_block: int | None = None
