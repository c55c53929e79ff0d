"""The jax releases each tokamax kernel is served on, and why not outside them.

tokamax 0.0.12 pins ``jax>=0.9.2`` but its Pallas kernels were written against
one JAX API, and JAX moved parts of it since: each gate below is what the suite
or a lowering found, on jax 0.10.2 (the compatibility line) and 0.12 (the
default one). A backend outside its line is refused in ``check`` with the
reason, never an import error or a crash at lowering. (The manifests'
``jax_versions`` stay the distribution's range: outside that, every registry
load would warn.)
"""

from __future__ import annotations

import dataclasses

from ._environment import TOKAMAX_CERTIFIED


@dataclasses.dataclass(frozen=True)
class JaxLine:
    """Served on jax releases ``first <= (major, minor) < stop`` (None: unbounded).

    ``why``: the reason outside them, written after ``"jax X.Y.Z: "``.
    """

    why: str
    first: tuple[int, int] | None = None
    stop: tuple[int, int] | None = None

    def reasons(self) -> list[str]:
        """Why the installed jax is outside this line (empty when it is inside)."""
        import jax

        release = tuple(int(part) for part in jax.__version__.split(".")[:2])
        if (self.first is None or release >= self.first) and (
                self.stop is None or release < self.stop):
            return []
        return [f"jax {jax.__version__}: {self.why}"]


#: On jax 0.10.2 the suite (interpret mode) found its backward wrong: dk and dv
#: of every GQA/MQA case (up to 9e4x the tolerance) and dq of the one-head,
#: unmasked Tq = Tk = 1031 case; its forward passed. The full table passes on 0.12.
MOSAIC_TPU = JaxLine(
    first=(0, 12),
    why="tokamax's Mosaic TPU backward failed the conformance suite on jax 0.10.2 (wrong "
        "dk/dv with GQA, wrong dq at T=1031); it is served on jax >= 0.12 only",
)

#: Where tokamax_triton and tokamax_mosaic_gpu are served: the compatibility line.
COMPAT_LINE = "make install-compat builds that line in .venv-jax-0.10"

#: The Pallas Triton kernel's dots are ``pl.dot``; JAX 0.12 removed it.
TRITON = JaxLine(
    stop=(0, 12),
    why=f"tokamax {TOKAMAX_CERTIFIED}'s Pallas Triton kernel calls pl.dot, which JAX 0.12 "
        "removed (AttributeError: pl.dot was deprecated in JAX v0.11.0, and removed in JAX "
        f"v0.12.0); it is served on jax < 0.12 only ({COMPAT_LINE})",
)

#: The Mosaic GPU kernels call ``plgpu.kernel(out_shape=..., scratch_shapes=...)``;
#: JAX 0.12 renamed both keywords (``out_type``, ``scratch_types``).
MOSAIC_GPU = JaxLine(
    stop=(0, 12),
    why=f"tokamax {TOKAMAX_CERTIFIED}'s Mosaic GPU kernels call plgpu.kernel(out_shape=...), "
        "a keyword JAX 0.12 renamed (TypeError: Mesh.__init__() got an unexpected keyword "
        f"argument 'out_shape'); they are served on jax < 0.12 only ({COMPAT_LINE})",
)
