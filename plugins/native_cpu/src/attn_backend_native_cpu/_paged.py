"""Paged attention through the FFI: one ``jax.ffi.ffi_call`` of the paged handler
over the canonical cache (K and V each ``[num_pages, page_size, Hkv, D]``; a
quantized cache's int8 or float8 values, read in place, and their scales
``[num_pages, page_size, Hkv]``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from attn_backends import KVCache, PagedBatch, PagedCall, UnsupportedError
from attn_backends.authoring import jax_api, vary_like

from ._kernel import ffi_results
from ._library import TARGETS, load_error


def paged_attention(call: PagedCall, q: Any, cache: KVCache, batch: PagedBatch,
                    threads: int) -> Any:
    """q ``[T, Hq, D]`` -> out ``[T, Hq, D]`` (q's dtype); rows no counted
    sequence owns are zeros. Forward only (serving): no gradient is defined."""
    reason = load_error()
    if reason is not None:
        raise UnsupportedError(f"native_cpu cannot run: {reason}")
    q, *arrays = vary_like((q, *cache.arrays), q, *cache.arrays)
    left = -1 if call.window is None else call.window[0]
    # A quantized cache (values, then K's and V's scales) has its own handler.
    target = TARGETS["paged_quantized" if call.quantized else "paged"][1]
    run = jax_api.ffi_call(target, ffi_results(q, (q.shape, q.dtype))[0],
                           vmap_method="sequential")
    as_i32 = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    return run(q, *arrays, as_i32(batch.cu_q_lens), as_i32(batch.kv_lens),
               as_i32(batch.page_table), as_i32(batch.num_seqs).reshape(1),
               scale=np.float32(call.scale), softcap=np.float32(call.softcap or 0.0),
               window_left=np.int64(left), threads=np.int64(threads))
