"""NumPy float64 oracle of paged attention (docs/DESIGN.md, "Paged attention").

Reads the cache in the canonical view (K and V ``[num_pages, page_size, Hkv, D]``)
one position at a time, straight from the contract's words: a loop over
sequences, rows and positions, no page gathering, no code shared with any
backend. Slow and small on purpose.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def paged_attention(q: Any, k_pages: Any, v_pages: Any, cu_q_lens: Any, kv_lens: Any,
                    page_table: Any, num_seqs: Any, *, scale: float | None = None,
                    softcap: float | None = None,
                    window: tuple[int, None] | None = None) -> np.ndarray:
    """q ``[T, Hq, D]``, K and V ``[num_pages, page_size, Hkv, D]`` and the batch's
    arrays -> out ``[T, Hq, D]`` float64; rows no counted sequence owns are zeros."""
    q = np.asarray(q, np.float64)
    k_pages, v_pages = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    cu, kv = np.asarray(cu_q_lens), np.asarray(kv_lens)
    table = np.asarray(page_table)
    rows, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    out = np.zeros((rows, hq, d))
    for s in range(int(np.asarray(num_seqs).reshape(()))):
        q_len, kv_len = int(cu[s + 1] - cu[s]), int(kv[s])
        for j in range(q_len):
            row, pos = int(cu[s]) + j, kv_len - q_len + j
            first = 0 if window is None else max(0, pos - window[0])
            seen = range(first, pos + 1)
            if not seen:
                continue
            keys = np.stack([k_pages[table[s, p // page_size], p % page_size] for p in seen])
            values = np.stack([v_pages[table[s, p // page_size], p % page_size] for p in seen])
            for h in range(hq):
                logits = scale * keys[:, h // group] @ q[row, h]
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                weights = np.exp(logits - logits.max())
                out[row, h] = weights @ values[:, h // group] / weights.sum()
    return out
