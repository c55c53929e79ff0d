"""Gemma 3 served on every backend that claims its calls (head dim 256, one KV head for
four query heads, a window of 512 keys on five layers of six): the same greedy
tokens as the peer's on each, through the paged engine and the dense prefill.

flash_pallas (in TPU interpret mode) serves the dense prefill of both kinds of
layer. Its paged kernels do not claim these calls (head dim 256; on cpu, float32
and the window too): preferred, the engine falls back loudly; pinned, it is an
error naming why. Its TPU export of a decode step through the dense contract
holds its Pallas kernels, one call per layer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_support import interpret_switches
from attn_backends import FallbackWarning, UnsupportedError
from attn_gemma3.model import decoder, logits_of, window_of

pytestmark = pytest.mark.slow(seconds=60)

PAGED_BACKENDS = ["reference", "xla_native", "native_cpu", "tokamax_xla", "tokamax_xla_chunked"]


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
def test_every_backend_serves_the_peers_greedy_tokens(model, peer, backend):
    prompt = peer["prompts"][0]  # "Once upon a time"
    pinned = model.using(backend=backend)
    new = pinned.generate_ids([prompt["ids"]], 8)[0]
    assert pinned.last_engine.backends() == {"local": backend, "global": backend}
    assert new == prompt["greedy"][:8], backend
    # the dense prefill on the same backend: the peer's top token at each position
    logits = pinned.logits(prompt["ids"], last=4)
    assert (logits.argmax(-1) == np.asarray(prompt["top_ids"])[-4:, 0]).all()


def test_flash_pallas_serves_the_prefill_and_its_paged_fallback_is_loud(model, peer):
    prompt = peer["prompts"][0]
    with interpret_switches():
        pinned = model.using(backend="flash_pallas")
        logits = pinned.logits(prompt["ids"])  # every position, both layer kinds
        np.testing.assert_allclose(np.take_along_axis(logits[-5:], np.asarray(
            prompt["top_ids"]), -1), prompt["top_logits"], atol=1e-3, rtol=0)
        with pytest.raises(UnsupportedError, match=r"backend='flash_pallas' cannot serve paged"
                           r" q\[T,4,256\].*head_dim=256 not in supported head dims \[128\]"):
            pinned.generate_ids([prompt["ids"]], 2)
        with pytest.warns(FallbackWarning, match="passing over flash_pallas: head_dim=256"):
            preferred = model.using(prefer="flash_pallas")
            new = preferred.generate_ids([prompt["ids"]], 8)[0]
    assert new == prompt["greedy"][:8]
    assert "flash_pallas" not in preferred.last_engine.backends().values()


def test_flash_pallas_tpu_export_of_a_decode_step_holds_its_kernels(model, monkeypatch):
    """A decode step through the dense contract: one new token per sequence
    attending to a contiguous cache of ``length`` positions, for a tpu."""
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    on_tpu = model.using(backend="flash_pallas", device="tpu")
    cfg, batch, length = model.cfg, 4, 1024

    def step(params, k_cache, v_cache, token, position):
        """token, position ``[batch]``; caches ``[layers, batch, length, 1, 256]``."""
        def attend(layer, q, k, v):
            rows = jnp.arange(batch)
            kc = k_cache[layer].at[rows, position].set(k)
            vc = v_cache[layer].at[rows, position].set(v)
            window = window_of(cfg, layer)
            return on_tpu.attention(q[:, None], kc, vc, causal=True, scale=cfg.scale,
                                    kv_lengths=position + 1,
                                    window=None if window is None else (window, 0))[:, 0]
        hidden = decoder(params, cfg, token, position, attend)
        return jnp.argmax(logits_of(params, hidden), -1)

    spec = jax.ShapeDtypeStruct
    params = jax.tree.map(lambda a: spec(a.shape, a.dtype), on_tpu.params)
    cache = spec((cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim), jnp.float32)
    rows = spec((batch,), jnp.int32)
    module = jax.export.export(jax.jit(step), platforms=["tpu"])(
        params, cache, cache, rows, rows).mlir_module()
    # The global layers (no window's left side): flash_pallas's own decode kernel,
    # inline, one each; the local ones stay on splash (a window's left side is not
    # a length), whose kernel JAX outlines into one function called per layer.
    kernels = re.findall(r'@tpu_custom_call\(.*kernel_name = "(\w+)"', module)
    assert kernels.count("contiguous_decode_attention") == 3, kernels
    assert kernels.count("splash_mha_fwd_segmented_residuals") == 1, kernels
    assert module.count("call @_splash_attention(") == 15
