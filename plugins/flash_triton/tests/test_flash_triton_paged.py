"""flash_triton's paged attention (docs/DESIGN.md, "Paged attention").

The shared case set (tests/_paged_support.py's :class:`PagedCases`) runs the
Pallas GPU paged kernel in interpret mode on CPU, with head dim 16 (the
kernel's smallest) and 16-key compute blocks of 4 pages in 2 table partitions
(interpret mode's defaults), so most cases put some keys in the kernel and the
rest in the edge blocks around it; one more case crosses several compute
blocks and both partitions, with and without a window. Selection for a
simulated GPU (no GPU here: by manifest), and a lowering for cuda that holds
the Triton call and no copy of the pool.
"""

from __future__ import annotations

import dataclasses

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import PS, PagedCases, paged_case
from _support import gpu_target
from attn_backend_flash_triton import ENV_VAR, FlashTritonBackend, TritonPagedBlocks, interpret_mode
from attn_backends.contract import jax_api

# JAX's Pallas Triton kernels are gone from jax >= 0.12 (deprecated in 0.12.0, removed in
# 0.12.1): there flash_triton is refused (test_flash_triton_plugin.py checks the reason)
# and these run on the jax 0.10 line (make test's compatibility run).
pytestmark = pytest.mark.skipif(
    jax_api.pallas_triton_ops_gone() is not None, reason="jax >= 0.12: the kernel is gone")

TRITON = "__gpu$xla.gpu.triton"



class TestFlashTritonPaged(PagedCases):
    backend = "flash_triton"
    head_dim = 16
    layout = "heads_first"
    float64 = False

    @pytest.fixture(autouse=True)
    def _interpret(self):
        with interpret_mode():
            yield

    @pytest.mark.parametrize("window", [None, (21, None)], ids=["causal", "window"])
    def test_several_compute_blocks_and_both_partitions(self, window):
        # 70 keys: the kernel takes [0, 64) (16 pages: 3 compute blocks in the
        # first partition, 1 in the second), the tail block the rest; with the
        # window, the kernel starts at a block boundary and a head block holds
        # the keys before it.
        call = {} if window is None else dict(window=window)
        self.agrees([(5, 70), (1, 45), (19, 40)], call=call, pad_rows=2)

    def test_options_reach_the_kernel(self):
        # 32-key blocks in 3 partitions: the 19-column table rounds up to 24
        # kernel columns, and 70 keys put a block in each of two partitions.
        self.options = TritonPagedBlocks(pages_per_compute_block=8, k_splits=3)  # this test's
        self.agrees([(5, 70), (1, 45), (19, 40)], call=dict(window=(37, None)), pad_rows=2)
        # Options the kernel cannot take fail the probe at get_paged, loudly.
        with pytest.raises(ab.UnsupportedError,
                           match="probe raised ValueError: .*makes compute blocks of 8 keys"):
            self.options = TritonPagedBlocks(pages_per_compute_block=2, k_splits=1)
            self.agrees([(1, 9)])

    def test_bfloat16_within_its_rounding(self):
        # The kernel's dots take bf16 (q scaled in bf16, weights cast to bf16);
        # the oracle runs in float64 on the same bf16-rounded inputs.
        case = paged_case([(5, 37), (1, 40)], page_size=PS, d=self.head_dim, pad_rows=1)
        rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
                   for x in (case.q, case.k_pages, case.v_pages)]
        case.q, case.k_pages, case.v_pages = rounded
        paged = self.paged(dtype="bfloat16")
        cache = paged.from_canonical(*(jnp.asarray(x, jnp.bfloat16) for x in rounded[1:]))
        out = jax.jit(paged.__call__)(jnp.asarray(case.q, jnp.bfloat16), cache, case.batch())
        assert out.dtype == jnp.bfloat16
        out = np.asarray(out.astype(jnp.float32))
        np.testing.assert_allclose(out, case.expected(), atol=2e-2, rtol=0)
        assert np.abs(out - case.expected()).max() > 0  # really computed in bf16


CALL = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")


def _specs(rows: int, seqs: int, pages: int, width: int):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pool = sds((pages, 16, 8, 128), jnp.bfloat16)
    batch = ab.PagedBatch(sds((seqs + 1,), i32), sds((seqs,), i32), sds((seqs, width), i32),
                          sds((), i32))
    return sds((rows, 32, 128), jnp.bfloat16), pool, batch


def _cuda_module(fn, *args) -> str:
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    with gpu_target():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=checks)(*args)
    return exported.mlir_module()


def test_a_simulated_gpu_selects_flash_triton_and_cpu_needs_the_switch(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    registry = ab.Registry(only=["flash_triton", "xla_native", "reference"])
    paged = registry.get_paged(device="gpu", **CALL, softcap=30.0, window=(64, None))
    assert paged.backend.name == "flash_triton" and paged.layout == "heads_first"
    assert paged.explanation.present is False  # no GPU here: chosen by manifest
    cpu = {v.backend: v for v in registry.explain_paged(device="cpu", **CALL).verdicts}
    assert not cpu["flash_triton"].accepted
    assert ENV_VAR in cpu["flash_triton"].reasons[0]
    refused = registry.explain_paged(device="gpu", **{**CALL, "head_dim": 96}).verdicts[0]
    assert refused.backend == "flash_triton" and not refused.accepted


def test_cuda_lowering_holds_the_triton_call_and_no_copy_of_the_pool():
    """A mixed batch (a 64-row prefill chunk and decode steps) on a 1000-page pool,
    with the gpu defaults (the backend as get_paged(device="gpu") binds it).

    Through the backend, with the call core would hand it: core refuses to run a
    PagedAttention for a platform JAX does not see (docs/DESIGN.md: export for an
    absent platform is a later phase); the next test lowers core's __call__."""
    paged = ab.Registry(only=["flash_triton"]).get_paged(device="gpu", **CALL, softcap=30.0,
                                                         window=(256, None))
    call = dataclasses.replace(paged.call, platform="gpu")
    q, pool, batch = _specs(rows=95, seqs=32, pages=1000, width=256)
    cache = jax.eval_shape(lambda k, v: paged.backend.from_canonical(call, k, v), pool, pool)
    text = _cuda_module(lambda q, cache, batch: paged.backend.attend_paged(call, q, cache, batch),
                        q, cache, batch)
    assert text.count(TRITON) == 1 and "flash_triton_paged" in text
    # The pool reaches the kernel as it lies: no op makes anything pool-sized (a
    # transpose, copy, pad or whole gather of it; 1000 pages, 16000 slots).
    assert "tensor<8x1000x16x128xbf16>" in text
    results = [line.rsplit("->", 1)[1] for line in text.splitlines()
               if "stablehlo." in line and "->" in line]
    assert results and not [r for r in results if "1000x" in r or "16000x" in r]


@pytest.mark.parametrize("page_size, head_dim, width", [(1, 16, 33), (4, 64, 300), (128, 32, 5)])
def test_the_claimed_extremes_lower_for_cuda(page_size, head_dim, width):
    # Smallest and largest page sizes and head dims of the manifest, and a table
    # whose partitions are not a power of two pages (300 pages: 16 x 24).
    paged = ab.Registry(only=["flash_triton"]).get_paged(
        device="gpu", **{**CALL, "page_size": page_size, "head_dim": head_dim})
    call = dataclasses.replace(paged.call, platform="gpu")
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pool = sds((500, page_size, 8, head_dim), jnp.bfloat16)
    batch = ab.PagedBatch(sds((9,), i32), sds((8,), i32), sds((8, width), i32), sds((), i32))
    cache = jax.eval_shape(lambda k, v: paged.backend.from_canonical(call, k, v), pool, pool)
    text = _cuda_module(lambda q, cache, batch: paged.backend.attend_paged(call, q, cache, batch),
                        sds((20, 32, head_dim), jnp.bfloat16), cache, batch)
    assert text.count(TRITON) == 1


def test_paged_call_through_core_exports_for_a_gpu_this_machine_lacks():
    # Selected for a gpu JAX does not see here (manifest only, unprobed): core's
    # __call__ exports for cuda with the compiled Triton kernel; the same call
    # selected on cpu in interpret mode is lowered for cpu only.
    paged = ab.registry.get_paged(device="gpu", backend="flash_triton", **CALL)
    q, pool, batch = _specs(rows=8, seqs=8, pages=64, width=8)
    cache = jax.eval_shape(paged.from_canonical, pool, pool)
    text = _cuda_module(paged.__call__, q, cache, batch)
    assert text.count(TRITON) == 1 and "attn_paged/flash_triton" in text
    with interpret_mode():
        on_cpu = ab.registry.get_paged(device="cpu", backend="flash_triton", **CALL)
        with pytest.raises(ab.PlatformUnavailableError, match="selected for cpu"):
            _cuda_module(on_cpu.__call__, q, cache, batch)


def test_paged_blocks_are_checked():
    with pytest.raises(ValueError, match="block_h must be a multiple of 16"):
        TritonPagedBlocks(pages_per_compute_block=8, k_splits=4, block_h=8)
    with pytest.raises(ValueError, match="k_splits must be an int >= 1"):
        TritonPagedBlocks(pages_per_compute_block=8, k_splits=0)
    with pytest.raises(ValueError, match="makes compute blocks of 24 keys"):
        TritonPagedBlocks(pages_per_compute_block=3, k_splits=1).block_keys(8)
    assert TritonPagedBlocks.default_for(16, interpret=False).block_keys(16) == 128
    assert FlashTritonBackend.paged_capabilities.page_sizes == frozenset(
        {1, 2, 4, 8, 16, 32, 64, 128})
