"""native_cpu's decode path (few query rows per kv head: items split the keys in
runs of 512, then merge) against the float64 oracle, over several splits: the
conformance suite's cases are shorter than one split."""

from __future__ import annotations

import attn_backends
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backend_native_cpu import NativeConfig
from attn_backend_native_cpu._plugin import NativeCpuBackend
from attn_backends.oracle import attention, paged_attention

BACKEND = NativeCpuBackend()


@pytest.mark.parametrize("tq", [1, 2])
def test_dense_decode_over_several_splits_matches_the_oracle(tq: int) -> None:
    # GQA 8:2 (4 rows per kv head at tq=1, 8 at tq=2: both decode); keys over
    # three splits, a batch row ending inside the second, a window across a split.
    rng = np.random.default_rng(0)
    b, tk, hq, hkv, d = 3, 1300, 8, 2, 32
    q = rng.standard_normal((b, tq, hq, d), np.float32)
    k = rng.standard_normal((b, tk, hkv, d), np.float32)
    v = rng.standard_normal((b, tk, hkv, d), np.float32)
    kwargs = dict(causal=True, window=(1000, None), kv_lengths=np.array([1300, 700, 513]),
                  return_lse=True)
    call, ops = attn_backends.bind(q, k, v, **kwargs)
    runs = [BACKEND.attend(call, q, k, v, ops, NativeConfig(threads)) for threads in (1, 2)]
    (out, lse), (out2, lse2) = [[np.asarray(x) for x in run] for run in runs]
    want_out, want_lse = attention(q, k, v, **{n: x for n, x in kwargs.items()
                                               if n != "return_lse"})
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=0)
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)


def test_paged_decode_over_several_splits_matches_the_oracle() -> None:
    # A prefill chunk of 40 rows (tiles) beside decode steps of 1 and 2 rows
    # (split items), keys over up to three splits through shuffled pages.
    rng = np.random.default_rng(1)
    hq, hkv, d, page_size, width = 8, 2, 32, 16, 100
    q_lens, kv_lens = [40, 1, 2], [600, 1100, 1500]
    pages = sum(-(-n // page_size) for n in kv_lens)
    order = rng.permutation(pages).astype(np.int32)
    table = np.zeros((3, width), np.int32)
    at = 0
    for s, n in enumerate(kv_lens):
        used = -(-n // page_size)
        table[s, :used] = order[at:at + used]
        at += used
    k_pages = rng.standard_normal((pages, page_size, hkv, d), np.float32)
    v_pages = rng.standard_normal((pages, page_size, hkv, d), np.float32)
    q = rng.standard_normal((sum(q_lens), hq, d), np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    batch = attn_backends.PagedBatch(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32),
                                     jnp.asarray(table), jnp.int32(3))
    paged = attn_backends.registry.get_paged(backend="native_cpu", num_q_heads=hq,
                                             num_kv_heads=hkv, head_dim=d,
                                             page_size=page_size, dtype="float32")
    cache = paged.from_canonical(jnp.asarray(k_pages), jnp.asarray(v_pages))
    out = np.asarray(paged(jnp.asarray(q), cache, batch))
    want = paged_attention(q, k_pages, v_pages, cu, np.asarray(kv_lens), table, 3)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)
