"""The ``ejkernel_xla`` backend: its manifest, its refusals, the lazy call into ``_flash``."""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import attn_backends
from attn_backends import AttentionCall, Backend, Operands
from attn_backends.authoring import distribution_version, manifest, resolve_options

from ._options import EjkernelOptions

#: The ejkernel release this adapter was read against and certified with (its
#: findings, plugins/ejkernel/README.md, are that release's).
EJKERNEL_VERSION = "0.0.80.3"
#: ejkernel 0.0.80.3 pins jax~=0.10.0: the jax line it installs on.
JAX_VERSIONS = ">=0.10,<0.11"
INSTALL = "pip install 'attn-backend-ejkernel[ejkernel]'"


@functools.cache
def _installed() -> str | None:
    """ejkernel's installed version, read from its metadata (nothing imported)."""
    try:
        return metadata.version("ejkernel")
    except metadata.PackageNotFoundError:
        return None


class EjkernelXlaBackend(Backend):
    """ejkernel's XLA flash attention (chunked online softmax, backward by autodiff
    of the chunked forward) behind the contract.

    The manifest is read from ejkernel 0.0.80.3's code and confirmed by the
    suite: no lse (the kernel returns none), no bias gradient (its custom VJP
    returns None for bias: a zero gradient), no float64 (its accumulators are
    float32 whatever the input), no dropout (its seed is a static int).
    """

    name = "ejkernel_xla"
    # "0+unknown" when run from a source tree that is not installed.
    version = distribution_version("attn-backend-ejkernel")
    api_version = 1
    capabilities = manifest(
        platforms={"cpu", "gpu", "tpu"},
        features={"gqa", "causal", "window", "segment_ids", "lengths", "mask", "bias",
                  "softcap"},
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        bias_grad=False,
        differentiable=True,
        deterministic=True,
        jax_versions=JAX_VERSIONS,
    )
    # Below this project's own kernels: chosen by name (backend= or prefer=),
    # or where nothing else serves a call.
    priority = {"cpu": -20, "gpu": -20, "tpu": -20}

    def check(self, call: AttentionCall) -> list[str]:
        found = _installed()
        if found is None:
            return [f"ejkernel is not installed: {INSTALL} (it pins jax~=0.10.0, so it "
                    "installs on the jax 0.10 line only)"]
        if found != EJKERNEL_VERSION:
            return [f"ejkernel {found} is installed; this adapter serves {EJKERNEL_VERSION}, "
                    f"the release its manifest was read from and certified with: {INSTALL}"]
        if call.v_head_dim != call.head_dim:
            # Its type checks name one head_dim for q, k and v (its loop would
            # take another for v).
            return [f"v_head_dim={call.v_head_dim} must equal head_dim={call.head_dim} "
                    "(ejkernel's type checks give q, k and v one head dim)"]
        if call.softcap is not None and call.bias_shape is not None:
            # ejkernel adds the bias before the softcap; the contract caps first.
            return ["softcap with bias: ejkernel caps scale*q.k + bias, the contract "
                    "caps scale*q.k and adds the bias after"]
        return []

    def tile_small_options(self, call: AttentionCall) -> EjkernelOptions:
        """Chunks of 16 query and 8 key rows (16 and 16 with a softcap, ejkernel's
        floor there), so short calls cross chunks and reach its remainder paths."""
        return EjkernelOptions(q_block=16, kv_block=8)

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, operands: Operands,
               options: Any = None) -> Any:
        from ._flash import attention

        return attention(call, q, k, v, operands,
                         resolve_options(options, EjkernelOptions, EjkernelOptions))


@attn_backends.hookimpl
def attn_backends_register() -> list[Backend]:
    return [EjkernelXlaBackend()]
