"""The lowering platform decides: a backend is lowered only for the platform it
was selected for, learns that platform, and a program exported for several
platforms carries one selection per platform (docs/DESIGN.md, section 3)."""

from __future__ import annotations

import re

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _docs import code_block
from attn_backend_xla_native import BlockConfig
from attn_backends.contract import jax_api
from attn_backends_contracts._oracle import attention as oracle

PLATFORMS_PAGE = "docs/guides/platforms.md"


def _no_locations(module: str) -> str:
    text = re.sub(r"\s*loc\([^)]*\)", "", module)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


@pytest.mark.parametrize("device", ["tpu", "gpu"])
def test_jit_on_this_cpu_of_an_absent_platform_raises_platform_unavailable(device):
    attention = ab.Registry().get(device=device, fallback="silent")
    q = jnp.ones((1, 16, 2, 64))
    step = jax.jit(lambda q: attention(q, q, q, causal=True))
    with pytest.raises(ab.PlatformUnavailableError,
                       match=rf"device='{device}': JAX sees no {device} here \(visible: cpu\)"):
        step(q)
    # The eager call says the same, before anything is traced.
    with pytest.raises(ab.PlatformUnavailableError, match=r"\(visible: cpu\)"):
        attention(q, q, q, causal=True)


def test_lowering_for_a_platform_not_selected_for_names_both():
    attention = ab.Registry(only=["reference"]).get(device="cpu")
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(
        ab.PlatformUnavailableError,
        match=r"selected for cpu is being lowered for tpu .*device=\.\.\.\) naming tpu",
    ):
        jax.export.export(jax.jit(lambda q: attention(q, q, q)), platforms=["tpu"])(q)


def test_export_for_tpu_gives_xla_native_its_tpu_blocks():
    registry = ab.Registry()
    q = jnp.ones((1, 1024, 2, 64))
    bias = jnp.zeros((1, 2, 1024, 1024))
    call, _ = ab.bind(q, q, q, bias=bias)
    assert registry.explain(q, q, q, bias=bias, device="tpu").chosen == "xla_native"
    tpu, cpu = (BlockConfig.default_for(call, p) for p in ("tpu", "cpu"))
    assert tpu != cpu  # else this test could not tell them apart

    def exported(options):
        attention = registry.get(device="tpu", backend_options=options, fallback="silent")
        step = jax.jit(lambda q, k, v, b: attention(q, k, v, bias=b))
        exported = jax.export.export(step, platforms=["tpu"])(q, q, q, bias)
        return _no_locations(exported.mlir_module())

    chosen = exported(None)
    assert chosen == exported({"xla_native": tpu})
    assert chosen != exported({"xla_native": cpu})


def test_export_for_tpu_of_a_flash_pallas_call_still_carries_its_kernel():
    attention = ab.Registry().get(device="tpu")
    q = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
    assert attention.explain(q, q, q, causal=True).chosen == "flash_pallas"
    step = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))
    module = jax.export.export(step, platforms=["tpu"])(q, q, q).mlir_module()
    assert "tpu_custom_call" in module


def test_one_export_for_tpu_cuda_and_cpu_runs_here_and_matches_the_oracle():
    attention = ab.Registry().get(device=["tpu", "gpu", "cpu"], backend="xla_native")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 40, 4, 32)), jnp.float32) for _ in range(3))
    step = jax.jit(lambda q, k, v: attention(q[:, :, :, :], k[:, :, :2], v[:, :, :2], causal=True))
    exported = jax.export.export(step, platforms=["tpu", "cuda", "cpu"])(q, k, v)
    assert exported.platforms == ("tpu", "cuda", "cpu")
    out = np.asarray(exported.call(q, k, v), np.float64)
    want, _ = oracle(
        *(np.asarray(x, np.float64) for x in (q, k[:, :, :2], v[:, :, :2])), causal=True
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


#: jax >= 0.12.1 lowers each branch of platform_dependent for its own platform only.
BRANCH_PER_PLATFORM = jax_api.release() >= (0, 12, 1)


def test_a_pallas_branch_shares_an_export_with_cpu_from_jax_0_12_1():
    """Before jax 0.12.1 JAX lowered every branch of platform_dependent for every
    listed platform, and pallas_call has no cpu lowering: one export for tpu and
    cpu failed. From 0.12.1 each branch is lowered for its platform alone: the
    export holds the TPU kernel and its cpu branch runs here, as the oracle says.
    Checked on each supported jax line. (cpu's branch is xla_native's: native_cpu's
    FFI call would stop the export at its safety check of custom calls.)"""
    attention = ab.Registry(only=["flash_pallas", "xla_native"]).get(device=["tpu", "cpu"])
    q = jnp.asarray(np.random.default_rng(3).standard_normal((1, 256, 2, 128)), jnp.float32)
    step = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))
    if not BRANCH_PER_PLATFORM:
        with pytest.raises(ValueError, match="Only interpret mode is supported on CPU backend"):
            jax.export.export(step, platforms=["tpu", "cpu"])(q, q, q)
        return
    exported = jax.export.export(step, platforms=["tpu", "cpu"])(q, q, q)
    assert "tpu_custom_call" in exported.mlir_module()
    out = exported.call(q, q, q)
    np.testing.assert_allclose(out, oracle(q, q, q, causal=True)[0], rtol=1e-4, atol=1e-4)


def test_a_backend_learns_the_platform_it_is_lowered_for():
    seen = []

    class Spy(ab.Backend):
        name = "spy"
        version = "1"
        capabilities = ab.Capabilities(platforms=frozenset({"cpu", "gpu", "tpu"}), gqa=True)

        def attend(self, call, q, k, v, operands, options=None):
            seen.append(call.platform)
            return jnp.zeros_like(q)

    class Plugin:
        @ab.hookimpl
        def attn_backends_register(self):
            return [Spy()]

    registry = ab.Registry(plugins=[Plugin()], autoload=False, probe=None)
    q = jnp.ones((1, 4, 2, 8))
    jax.jit(lambda q: registry.get()(q, q, q)).lower(q)
    jax.export.export(jax.jit(lambda q: registry.get(device="tpu")(q, q, q)), platforms=["tpu"])(q)
    both = registry.get(device=["gpu", "cpu"])
    jax.export.export(jax.jit(lambda q: both(q, q, q)), platforms=["cuda", "cpu"])(q)
    assert seen == ["cpu", "tpu", "cpu", "gpu"]


def test_the_docs_portable_export_example_runs_and_matches_the_oracle():
    block = code_block(PLATFORMS_PAGE, "# example: portable export")
    scope: dict = {}
    exec(compile(block, f"{PLATFORMS_PAGE} (portable export)", "exec"), scope)
    assert scope["exported"].platforms == ("tpu", "cuda", "cpu")
    q64 = np.asarray(scope["q"], np.float64)
    want, _ = oracle(q64, q64, q64, causal=True)
    np.testing.assert_allclose(np.asarray(scope["out"], np.float64), want, rtol=1e-5, atol=1e-5)
