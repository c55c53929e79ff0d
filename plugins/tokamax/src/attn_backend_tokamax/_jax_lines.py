"""The jax releases each tokamax kernel is served on, and why not outside them.

tokamax 0.0.12 pins ``jax>=0.9.2`` but its Pallas kernels were written against
one JAX API, and JAX moved parts of it since: each gate below is what the suite
or a lowering found with tokamax 0.0.12, on jax 0.10.2 (the compatibility line)
and 0.12. tokamax 0.0.17 (the newest line's, jax 0.12.1) needs none of those:
its Triton and Mosaic kernels follow JAX 0.12's API; its Mosaic GPU kernels are
gated as uncertified (the last gate). A backend outside its line is refused
in ``check`` with the reason, never an import error or a crash at lowering.
(The manifests' ``jax_versions`` stay the distribution's range: outside that,
every registry load would warn.)
"""

from __future__ import annotations

import dataclasses

from ._environment import tokamax_version


@dataclasses.dataclass(frozen=True)
class JaxLine:
    """With tokamax ``tokamax``, served on jax releases ``first <= (major, minor) <
    stop`` (None: unbounded); another tokamax release is not gated here.

    ``why``: the reason outside them, written after ``"jax X.Y.Z: "``.
    """

    why: str
    tokamax: str
    first: tuple[int, int] | None = None
    stop: tuple[int, int] | None = None

    def reasons(self) -> list[str]:
        """Why the installed jax is outside this line (empty when it is inside)."""
        import jax
        from attn_backends.authoring import jax_api

        if tokamax_version() != self.tokamax:
            return []
        release = jax_api.release()
        if (self.first is None or release >= self.first) and (
                self.stop is None or release < self.stop):
            return []
        return [f"jax {jax.__version__}: {self.why}"]


#: On jax 0.10.2 the suite (interpret mode) found its backward wrong: dk and dv
#: of every GQA/MQA case (up to 9e4x the tolerance) and dq of the one-head,
#: unmasked Tq = Tk = 1031 case; its forward passed. The full table passes on 0.12.
MOSAIC_TPU = JaxLine(
    tokamax="0.0.12",
    first=(0, 12),
    why="tokamax's Mosaic TPU backward failed the conformance suite on jax 0.10.2 (wrong "
        "dk/dv with GQA, wrong dq at T=1031); it is served on jax >= 0.12 only",
)

#: Where tokamax_triton and tokamax_mosaic_gpu are served: the compatibility line.
COMPAT_LINE = "make install-compat builds that line in .venv-jax-0.10"

#: The Pallas Triton kernel's dots are ``pl.dot``; JAX 0.12 removed it.
TRITON = JaxLine(
    tokamax="0.0.12",
    stop=(0, 12),
    why="tokamax 0.0.12's Pallas Triton kernel calls pl.dot, which JAX 0.12 "
        "removed (AttributeError: pl.dot was deprecated in JAX v0.11.0, and removed in JAX "
        f"v0.12.0); it is served on jax < 0.12 only ({COMPAT_LINE}), and tokamax 0.0.17's on "
        "jax >= 0.12",
)

#: The Mosaic GPU kernels call ``plgpu.kernel(out_shape=..., scratch_shapes=...)``;
#: JAX 0.12 renamed both keywords (``out_type``, ``scratch_types``).
MOSAIC_GPU = JaxLine(
    tokamax="0.0.12",
    stop=(0, 12),
    why="tokamax 0.0.12's Mosaic GPU kernels call plgpu.kernel(out_shape=...), "
        "a keyword JAX 0.12 renamed (TypeError: Mesh.__init__() got an unexpected keyword "
        f"argument 'out_shape'); they are served on jax < 0.12 only ({COMPAT_LINE}), and "
        "tokamax 0.0.17's on jax >= 0.12",
)

#: tokamax 0.0.17's Mosaic GPU kernels, never lowered or run here: on jax 0.12.1 a
#: Mosaic GPU kernel lowers only where JAX's CUDA plugin is installed ("Mosaic GPU
#: not supported on this platform" without it), and the kernels ask JAX's default
#: device for its core count, which no stand-in device here has. Served on no jax
#: line with that release until a Hopper certifies it.
MOSAIC_GPU_UNCERTIFIED = JaxLine(
    tokamax="0.0.17",
    stop=(0, 0),
    why="tokamax 0.0.17's Mosaic GPU kernels are not certified: they lower only where JAX "
        "sees a Hopper or Blackwell GPU with its CUDA plugin, which this project's CI lacks; "
        "certify them there (make test-gpu) and lift this gate, or use tokamax_triton",
)
