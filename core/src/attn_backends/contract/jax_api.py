"""The JAX APIs that moved between the jax lines attn-backends serves: one place.

Core and the backends in this repository call these functions, never the moved
APIs themselves, so the next move of JAX's API is a change to this file (and
to ``tests/core/test_jax_api.py``, which runs on both lines). Each function
names the releases each of its branches covers; the lines tested are jax 0.10
(``.venv-jax-0.10``) and the newest one (``.venv``, requirements/main.txt).
A branch is picked by what the installed JAX has, where that can be asked (a
release in between takes whichever it offers), and by :func:`release` where
an API is still there but deprecated (JAX's Pallas Triton kernels in 0.12.0).

Importing this module imports jax and nothing of ``jax.extend``, Pallas or
export: those load on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax


def is_single_device_sharding(sharding: Any) -> bool:
    """Whether ``sharding`` places the whole array on one device.

    jax >= 0.12.1: ``jax.sharding.is_single_device_sharding`` (the class
    ``SingleDeviceSharding`` is deprecated there: a ``DeprecationWarning`` on
    every attribute access). jax 0.10 to 0.12.0: ``isinstance`` of that class.
    """
    test = getattr(jax.sharding, "is_single_device_sharding", None)
    if test is not None:
        return bool(test(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


def aval_of(x: Any) -> Any:
    """The abstract value of ``x`` (an array, a ShapeDtypeStruct or a tracer), with
    its ``sharding`` and, inside ``shard_map``, its ``manual_axis_type``.

    jax 0.10 to 0.12.x: ``jax.typeof`` (``jax.core.get_aval`` before it).
    """
    return jax.typeof(x)


def shard_map(body: Callable[..., Any], *, mesh: Any, in_specs: Any, out_specs: Any,
              check_vma: bool, axis_names: Any = None) -> Callable[..., Any]:
    """``body`` mapped over ``mesh``'s devices (``axis_names``: the manual axes, None:
    every axis of ``mesh``).

    jax 0.10 to 0.12.x: ``jax.shard_map`` with ``check_vma`` and ``axis_names``
    (``jax.experimental.shard_map.shard_map`` with ``check_rep`` and ``auto`` is
    deprecated since jax 0.8).
    """
    extra = {} if axis_names is None else {"axis_names": axis_names}
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma, **extra)


def cast_varying(x: Any, axes: tuple[str, ...]) -> Any:
    """``x`` typed as varying over the manual ``axes`` of a ``shard_map`` (no data moves).

    jax 0.10 to 0.12.x: ``jax.lax.pcast(x, axes, to="varying")`` (``jax.lax.pvary``
    before it).
    """
    return jax.lax.pcast(x, axes, to="varying")


def context_mesh() -> Any:
    """The concrete mesh of ``jax.sharding.set_mesh`` in context, or None.

    jax 0.10 to 0.12.x: ``jax._src.mesh.get_concrete_mesh``; the public
    ``jax.sharding.get_mesh`` refuses under ``jit``, where this is asked too.
    """
    from jax._src import mesh as meshes

    return meshes.get_concrete_mesh()


def distributed_client() -> Any:
    """The coordination service's client of ``jax.distributed.initialize`` (its
    key-value store), or None in a run without one.

    jax 0.10 to 0.12.x: ``jax._src.distributed.global_state.client`` (private; no
    public getter).
    """
    from jax._src import distributed

    return distributed.global_state.client


def cudnn_version() -> int | None:
    """cuDNN's version as JAX sees it (e.g. 91000 for 9.10.0), or None without it.

    jax 0.10 to 0.12.x: ``jax._src.lib.cuda_versions.cudnn_get_version()`` (private;
    the module is None, or missing, without JAX's CUDA plugin).
    """
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no cuDNN" here
        return None


def default_device() -> Any:
    """JAX's default device (a ``jax.default_device`` in context included).

    jax 0.10 to 0.12.x: ``jax.extend.backend.get_default_device()``.
    """
    from jax.extend import backend

    return backend.get_default_device()


def initialised_backends() -> dict[str, Any]:
    """JAX's table of initialised backends (platform -> client); initialises none.

    jax 0.10 to 0.12.x: ``jax.extend.backend.backends()``.
    """
    from jax.extend import backend

    return backend.backends()


def export(fn: Callable[..., Any], platforms: Sequence[str]) -> Callable[..., Any]:
    """``jax.jit(fn)`` exported for the lowering ``platforms`` ("cpu", "cuda", "tpu", ...).

    jax 0.10 to 0.12.x: ``jax.export.export(jitted, platforms=...)``.
    """
    from jax import export as jax_export

    return jax_export.export(jax.jit(fn), platforms=tuple(platforms))


def new_primitive(name: str) -> Any:
    """A fresh ``Primitive`` named ``name``, with ``register_lowering`` beside it.

    jax 0.10 to 0.12.x: ``jax.extend.core.Primitive`` and
    ``jax.interpreters.mlir.register_lowering``.
    """
    from jax.extend.core import Primitive

    return Primitive(name)


def register_lowering(primitive: Any, rule: Callable[..., Any]) -> None:
    """``rule`` lowers ``primitive`` on every platform (see :func:`new_primitive`)."""
    from jax.interpreters import mlir

    mlir.register_lowering(primitive, rule)


def ffi_missing() -> list[str]:
    """The names of ``jax.ffi`` a native backend calls that this JAX lacks (empty: none).

    jax 0.4.36 to 0.12.x: ``jax.ffi.ffi_call``, ``register_ffi_target`` and
    ``pycapsule`` (``jax.extend.ffi`` before).
    """
    import jax.ffi

    return [name for name in ("ffi_call", "register_ffi_target", "pycapsule")
            if not hasattr(jax.ffi, name)]


def register_ffi_target(name: str, handler: Any, platform: str) -> None:
    """Register the C symbol ``handler`` (a ctypes function) as the FFI target ``name``
    on ``platform`` ("cpu", "CUDA").

    jax 0.4.36 to 0.12.x: ``jax.ffi.register_ffi_target(name,
    jax.ffi.pycapsule(handler), platform=...)`` (typed FFI, api_version 1).
    """
    import jax.ffi

    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform=platform)


def ffi_call(name: str, results: Any, **options: Any) -> Callable[..., Any]:
    """``jax.ffi.ffi_call(name, results, **options)`` (jax 0.4.36 to 0.12.x)."""
    import jax.ffi

    return jax.ffi.ffi_call(name, results, **options)


#: The GPU a cuda lowering on a host without one targets, unless told otherwise.
DEFAULT_GPU = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def lowering_for_absent_gpu(device_kind: str = DEFAULT_GPU) -> Iterator[None]:
    """Lower for cuda inside this block on a host without a GPU, as for ``device_kind``.

    jax >= 0.12.1: a Pallas Triton kernel reads the target GPU's compute
    capability while lowering, from the abstract device of the abstract mesh in
    context ("No supported GPU devices found, please specify an abstract GPU
    device using AbstractDevice" otherwise). jax 0.10 to 0.12.0 lowered without
    one; the same abstract mesh is harmless there.
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                         platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                  abstract_device=device)):
        yield


def release() -> tuple[int, ...]:
    """The installed jax's release numbers, e.g. ``(0, 12, 1)`` for 0.12.1 (compare
    with a prefix: ``release() >= (0, 12)``)."""
    import re

    return tuple(int(part) for part in re.findall(r"\d+", jax.__version__)[:3])


#: Why JAX's own Pallas Triton kernels cannot be served on jax >= 0.12 (None below).
PALLAS_TRITON_OPS_GONE = (
    "JAX's Pallas Triton kernels (jax.experimental.pallas.ops.gpu.attention and "
    ".paged_attention) were deprecated in jax 0.12.0 and removed in 0.12.1: served on jax "
    "< 0.12 only; on a GPU with this jax, tokamax_triton (tokamax's Pallas Triton flash "
    "attention) or cudnn serve instead")


def pallas_triton_ops_gone() -> str | None:
    """Why ``jax.experimental.pallas.ops.gpu.attention`` / ``.paged_attention`` are not
    to be used with the installed jax (None: they are there, undeprecated).

    jax 0.10 to 0.11.x: present. jax 0.12.0: present, deprecated (a
    ``DeprecationWarning`` at import pointing to tokamax). jax >= 0.12.1: removed
    (only ``attention_mgpu``, Mosaic GPU, is left there).
    """
    return PALLAS_TRITON_OPS_GONE if release() >= (0, 12) else None


def pallas_triton_ops(name: str) -> Any:
    """``jax.experimental.pallas.ops.gpu.<name>`` ("attention", "paged_attention") on a
    jax that has them (:func:`pallas_triton_ops_gone` is None); ImportError otherwise."""
    gone = pallas_triton_ops_gone()
    if gone is not None:
        raise ImportError(f"jax {jax.__version__}: {gone}")
    import importlib

    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
