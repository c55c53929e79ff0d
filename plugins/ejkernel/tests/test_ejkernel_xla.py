"""ejkernel_xla on the jax 0.10 line (make test's compatibility run), where ejkernel
installs: each finding of plugins/ejkernel/README.md shown on ejkernel itself (its
minimal reproduction) and answered by the adapter, both against core's float64
oracle; and neither ``import attn_backends`` nor ``attn-backends list`` imports
ejkernel. The whole suite runs in make test's certify-compat-ejkernel_xla.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends import oracle

if importlib.util.find_spec("ejkernel") is None:  # found, not imported: see kernel()
    pytest.skip("ejkernel pins jax~=0.10.0: make test installs it in .venv-jax-0.10 and runs "
                "this file there; on the jax 0.12 line test_refused_on_this_jax.py runs instead",
                allow_module_level=True)

B, TQ, TK, H, D = 2, 3, 8, 2, 8


def _flash():
    """ejkernel's own XLA flash attention, from its kernel registry."""
    from attn_backend_ejkernel._flash import kernel

    return kernel()


@pytest.fixture(scope="module")
def qkv() -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in ((B, TQ, H, D), (B, TK, H, D), (B, TK, H, D)))


@pytest.fixture(scope="module")
def served() -> ab.Attention:
    return ab.Registry(probe=None).get(device="cpu", backend="ejkernel_xla", fallback="error")


def test_neither_import_nor_list_imports_ejkernel_nor_does_a_call_change_jax() -> None:
    """ejkernel's import points JAX's compilation cache at ~/.cache/ejkernel-cache
    and sets two environment variables; the first call imports it and undoes that."""
    code = ("import os, sys, attn_backends, jax, jax.numpy as jnp\n"
            "from attn_backends_cli.main import main\n"
            "assert 'ejkernel_xla' in attn_backends.registry.backends\n"
            "main(['list'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ejkernel'))\n"
            "x = jnp.ones((1, 4, 2, 8))\n"
            "attn_backends.registry.get(backend='ejkernel_xla', fallback='error')(x, x, x)\n"
            "assert 'ejkernel' in sys.modules\n"
            "print(jax.config.jax_compilation_cache_dir, os.environ.get('TF_GPU_ALLOCATOR'))\n")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert any("ejkernel_xla" in line for line in lines)
    assert lines[-2:] == ["[]", "None None"]


def test_causal_is_aligned_top_left_there_bottom_right_here(qkv, served) -> None:
    q, k, v = qkv
    want, _ = oracle.attention(q, k, v, causal=True)
    theirs = _flash()(q, k, v, causal=True)
    # ejkernel's row i sees keys 0..i; the contract's sees 0..i + Tk - Tq.
    top_left, _ = oracle.attention(q, k, v, mask=np.tril(np.ones((TQ, TK), bool)))
    np.testing.assert_allclose(theirs, top_left, atol=1e-5)
    assert np.abs(np.asarray(theirs) - want).max() > 0.1
    np.testing.assert_allclose(served(q, k, v, causal=True), want, atol=1e-5)


def test_a_row_that_sees_nothing_is_zeros_not_the_mean_of_v(qkv, served) -> None:
    q, k, v = qkv
    mask = np.ones((B, 1, TQ, TK), bool)
    mask[1] = False  # the second sequence sees no key
    theirs = np.asarray(_flash()(q, k, v, attention_mask=jnp.asarray(mask)))
    # ejkernel hides a key with finfo.min: every logit equal, the mean of v.
    np.testing.assert_allclose(theirs[1], np.broadcast_to(v[1].mean(0), (TQ, H, D)), atol=1e-5)
    want, _ = oracle.attention(q, k, v, mask=mask)
    assert not want[1].any()
    np.testing.assert_allclose(served(q, k, v, mask=jnp.asarray(mask)), want, atol=1e-5)


def test_negative_segment_ids_are_ids_not_padding(qkv, served) -> None:
    q, k, v = qkv
    q_ids = jnp.asarray([[-1, -1, 3]] * B, jnp.int32)
    kv_ids = jnp.asarray([[-1] * 5 + [3] * 3] * B, jnp.int32)
    want, _ = oracle.attention(q, k, v, segment_ids=(q_ids, kv_ids))
    theirs = np.asarray(_flash()(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids))
    # ejkernel drops a query whose id is negative: its row averages every v.
    np.testing.assert_allclose(theirs[:, :2], np.broadcast_to(
        np.asarray(v).mean(1)[:, None], (B, 2, H, D)), atol=1e-5)
    np.testing.assert_allclose(served(q, k, v, segment_ids=(q_ids, kv_ids)), want, atol=1e-5)


def test_the_bias_gradient_is_zero_there_and_refused_here(qkv, served) -> None:
    q, k, v = qkv
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((B, H, TQ, TK)), jnp.float32)
    d_bias = jax.grad(lambda b: _flash()(q, k, v, bias=b).sum())(bias)
    assert not np.asarray(d_bias).any()  # its custom VJP returns None for bias
    with pytest.raises(ab.UnsupportedError, match="bias"):
        jax.grad(lambda b: served(q, k, v, bias=b).sum())(bias)


def test_softcap_with_bias_is_declined_ejkernel_caps_after_the_bias(qkv) -> None:
    q, k, v = qkv
    bias = jnp.full((B, H, TQ, TK), 4.0, jnp.float32).at[..., 0].set(-4.0)
    want, _ = oracle.attention(q, k, v, bias=bias, softcap=1.0)
    theirs = np.asarray(_flash()(q, k, v, bias=bias, logits_soft_cap=1.0))
    # ejkernel: softmax(c * tanh((s + bias) / c)) v, in float64 here (H == Hkv).
    s = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) * D ** -0.5
    p = np.exp(np.tanh(s + np.float64(bias)))
    capped_after = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), np.float64(v))
    np.testing.assert_allclose(theirs, capped_after, atol=1e-5)
    assert np.abs(theirs - want).max() > 0.05
    exp = ab.Registry(probe=None).get(device="cpu").explain(q, k, v, bias=bias, softcap=1.0)
    verdict = next(x for x in exp.verdicts if x.backend == "ejkernel_xla")
    assert any("softcap with bias" in r for r in verdict.reasons), verdict.reasons


def test_its_ragged_paged_attention_reads_nan_past_kv_len_so_it_is_not_wrapped() -> None:
    """Why ejkernel's ragged_page_attention_v2 (XLA) is not served for paged calls: a
    NaN in a slot past a sequence's kv length, which the paged contract says never
    changes a result, reaches the output (hidden weights are zeroed, then 0 * NaN
    in weights @ V); and its window keeps one key fewer than the contract's."""
    from ejkernel.kernels import kernel_registry  # imported by _flash() already

    _flash()
    rpa = kernel_registry.get("ragged_page_attention_v2", platform="xla", backend="any")
    page, hd = 4, 8
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((2, page, 2, hd)).astype(np.float32)  # K, V interleaved
    q = jnp.asarray(rng.standard_normal((1, 1, hd)), jnp.float32)  # one decode row
    args = dict(context_lens=jnp.array([3], jnp.int32), block_tables=jnp.array([[0]], jnp.int32),
                query_start_loc=jnp.array([0, 1], jnp.int32), num_seqs=jnp.array([1], jnp.int32),
                softmax_scale=hd ** -0.5, compute_dtype=jnp.float32)
    k, v = np.float64(pages[0, :3, 0]), np.float64(pages[0, :3, 1])

    def contract(first: int) -> np.ndarray:  # the row (position 2) over keys first..2
        s = k[first:] @ np.float64(q[0, 0]) * hd ** -0.5
        p = np.exp(s - s.max())
        return p / p.sum() @ v[first:]

    np.testing.assert_allclose(rpa(q, jnp.asarray(pages), **args)[0, 0], contract(0), atol=1e-5)
    # window=(1, None) keeps keys 1..2 in the contract; ejkernel's 1 keeps key 2 only.
    windowed = rpa(q, jnp.asarray(pages), sliding_window=1, **args)[0, 0]
    np.testing.assert_allclose(windowed, contract(2), atol=1e-5)
    pages[0, 3] = np.nan  # slot 3 of page 0: past kv_lens=3
    assert np.isnan(np.asarray(rpa(q, jnp.asarray(pages), **args))).all()


def test_float16_logits_overflow_there_and_are_float32_here(qkv, served) -> None:
    q, k, v = (x.astype(jnp.float16) for x in qkv)
    q, k = q * 300, k * 300  # q.k past float16's 65504; the logits themselves are not
    assert np.isnan(np.asarray(_flash()(q, k, v), np.float32)).all()
    want, _ = oracle.attention(q, k, v)
    np.testing.assert_allclose(np.asarray(served(q, k, v), np.float32), want, atol=2e-2)
