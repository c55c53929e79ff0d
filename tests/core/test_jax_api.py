"""attn_backends.contract.jax_api, the one place that knows JAX's moved APIs, on each line.

make test runs this file on both jax lines (tests/core is in the compatibility
run): each function must give the same answer through whichever branch the
installed jax takes, without a DeprecationWarning (pytest's filterwarnings
turns one into a failure).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends.contract import jax_api
from jax.sharding import NamedSharding, PartitionSpec

RELEASE = tuple(int(p) for p in jax.__version__.split(".")[:2])


def _mesh() -> jax.sharding.Mesh:
    """A one-device mesh with an Auto axis "x" (jax.make_mesh's are Explicit on 0.12)."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))


def test_single_device_shardings_are_told_from_mesh_ones() -> None:
    on_one = jnp.zeros(3)
    assert jax_api.is_single_device_sharding(on_one.sharding)
    mesh = _mesh()
    assert not jax_api.is_single_device_sharding(NamedSharding(mesh, PartitionSpec("x")))


def test_shard_map_maps_with_check_vma_and_the_varying_cast() -> None:
    """The manual axis reaches the body's avals (varying) and a constant cast to varying
    joins them: what vary_like needs inside a user's shard_map."""
    mesh = _mesh()
    seen = {}

    def body(a: jax.Array) -> jax.Array:
        seen["axes"] = jax_api.aval_of(a).manual_axis_type.varying
        zero = jax_api.cast_varying(jnp.zeros(a.shape, a.dtype), ("x",))
        return jax.lax.fori_loop(0, 2, lambda i, c: c + a, zero)

    mapped = jax_api.shard_map(body, mesh=mesh, in_specs=PartitionSpec("x"),
                               out_specs=PartitionSpec("x"), check_vma=True)
    out = jax.jit(mapped)(jnp.arange(4.0))
    np.testing.assert_array_equal(out, 2 * np.arange(4.0))
    assert seen["axes"] == frozenset({"x"})


def test_export_lowers_for_the_platforms_named() -> None:
    exported = jax_api.export(lambda a: a * 2, ["cpu", "tpu"])(
        jax.ShapeDtypeStruct((3,), jnp.float32))
    assert tuple(exported.platforms) == ("cpu", "tpu")


def test_a_new_primitive_lowers_by_the_rule_registered() -> None:
    primitive = jax_api.new_primitive("attn_backends_test_jax_api_double")
    primitive.def_abstract_eval(lambda x: x)
    primitive.def_impl(lambda x: x * 2)

    def lowering(ctx, x):  # noqa: ANN001, ANN202 - JAX's lowering-rule signature
        from jax.interpreters import mlir

        return mlir.lower_fun(lambda y: y * 2, multiple_results=False)(ctx, x)

    jax_api.register_lowering(primitive, lowering)
    np.testing.assert_array_equal(jax.jit(primitive.bind)(jnp.ones(2)), [2.0, 2.0])


def test_ffi_names_a_native_backend_calls_are_all_there() -> None:
    assert jax_api.ffi_missing() == []


def test_the_context_mesh_is_set_mesh_s() -> None:
    assert jax_api.context_mesh() is None or jax_api.context_mesh().empty
    mesh = _mesh()
    with jax.sharding.set_mesh(mesh):
        assert jax_api.context_mesh() == mesh


def test_lowering_for_an_absent_gpu_names_the_abstract_device() -> None:
    with jax_api.lowering_for_absent_gpu("NVIDIA H100 80GB HBM3"):
        device = jax.sharding.get_abstract_mesh().abstract_device
    assert (device.platform, device.device_kind) == ("gpu", "NVIDIA H100 80GB HBM3")
    assert jax.sharding.get_abstract_mesh().abstract_device is None


def test_pallas_triton_kernels_are_there_below_jax_0_12_and_gone_from_it() -> None:
    """JAX 0.12.0 deprecated jax.experimental.pallas.ops.gpu.attention and
    .paged_attention, 0.12.1 removed them: flash_triton serves below 0.12 only."""
    gone = jax_api.pallas_triton_ops_gone()
    if RELEASE < (0, 12):
        assert gone is None
        assert hasattr(jax_api.pallas_triton_ops("attention"), "mha")
        assert hasattr(jax_api.pallas_triton_ops("paged_attention"), "paged_attention")
    else:
        assert "removed in 0.12.1" in gone and "tokamax_triton" in gone
        with pytest.raises(ImportError, match=f"jax {jax.__version__}: JAX's Pallas Triton"):
            jax_api.pallas_triton_ops("attention")


def test_no_coordination_client_and_no_cudnn_in_this_single_cpu_process() -> None:
    """Both read private JAX modules: here they must answer, not raise (the
    multi-process tests reach the client, the GPU tests cuDNN's version)."""
    assert jax_api.distributed_client() is None
    assert jax_api.cudnn_version() is None
