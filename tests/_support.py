"""Helpers for the repo's own tests: in-process fake backends and arrays."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attn_backends as ab
import jax
import jax.numpy as jnp
import numpy as np
from attn_backends import Backend, Capabilities, hookimpl

ALL_FEATURES = dict(
    gqa=True, causal=True, window=True, segment_ids=True, lengths=True, mask=True,
    bias=True, bias_grad=True, softcap=True, return_lse=True, differentiable=True,
)


def dense(call: ab.AttentionCall, q: Any, k: Any, v: Any, ops: ab.Operands) -> Any:
    """Plain jnp attention for fakes that must compute something, so core's tests
    need no plugin: float32 logits, the contract's visibility, zeros (lse -inf) for
    rows that see no key. q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk,
    Hkv, Dv]`` -> out ``[B, Tq, Hq, Dv]`` (and lse ``[B, Hq, Tq]``)."""
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    kk, vv = (jnp.repeat(f32(x), call.group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", f32(q), kk, precision="highest") * call.scale
    if call.softcap is not None:
        s = call.softcap * jnp.tanh(s / call.softcap)
    if ops.bias is not None:
        s = s + ops.bias
    row, col = jnp.arange(call.q_len)[:, None], jnp.arange(call.kv_len)[None, :]
    left, right = call.window or (None, None)
    vis = jnp.ones((1, 1, call.q_len, call.kv_len), bool)
    if call.causal:
        vis &= col <= row + call.offset
    if left is not None:
        vis &= col >= row + call.offset - left
    if right is not None:
        vis &= col <= row + call.offset + right
    if ops.q_segment_ids is not None:
        vis &= (ops.q_segment_ids[:, :, None] == ops.kv_segment_ids[:, None, :])[:, None]
    if ops.kv_lengths is not None:
        vis &= (col < ops.kv_lengths[:, None, None])[:, None]
    if ops.q_lengths is not None:
        vis &= (row < ops.q_lengths[:, None, None])[:, None]
    if ops.mask is not None:
        vis &= ops.mask
    peak = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -jnp.inf), -1, keepdims=True))
    p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    seen = total > 0
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(seen, total, 1.0), vv,
                     precision="highest").astype(q.dtype)
    lse = jnp.where(seen, jnp.log(jnp.where(seen, total, 1.0)) + peak, -jnp.inf)[..., 0]
    return (out, lse) if call.return_lse else out


def make_backend(
    name: str,
    *,
    priority: int = 10,
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu"),
    check: Callable[[ab.AttentionCall], list[str]] | None = None,
    attend: Callable[..., Any] | None = None,
    jax_versions: str = "",
    api_version: int = 1,
    **features: bool,
) -> Backend:
    """A Backend instance with the given manifest; computes dense attention by default."""
    caps = Capabilities(
        platforms=frozenset(platforms), jax_versions=jax_versions, **{**ALL_FEATURES, **features}
    )

    class Fake(Backend):
        version = "9.9"

        def check(self, call: ab.AttentionCall) -> list[str]:
            return check(call) if check else []

        def attend(self, call, q, k, v, operands, options=None):  # type: ignore[no-untyped-def]
            return (attend or dense)(call, q, k, v, operands)

    Fake.name = name
    Fake.capabilities = caps
    Fake.priority = {p: priority for p in ("cpu", "gpu", "tpu")}
    Fake.api_version = api_version
    return Fake()


class Plugin:
    """An in-process plugin object offering the given backends."""

    def __init__(self, *backends: Backend):
        self.backends = list(backends)

    @hookimpl
    def attn_backends_register(self) -> list[Backend]:
        return self.backends



def qkv(
    b: int = 2, tq: int = 8, tk: int = 8, hq: int = 4, hkv: int = 2, d: int = 8,
    dv: int | None = None, dtype: Any = jnp.float32, seed: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random q ``[b,tq,hq,d]``, k ``[b,tk,hkv,d]``, v ``[b,tk,hkv,dv]``."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, tq, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, tk, hkv, dv or d)), dtype)
    return q, k, v


_counter = itertools.count()

BACKEND_SOURCE = '''
from attn_backends import Backend, Capabilities, hookimpl

class B(Backend):
    name = {name!r}
    version = "1.0"
    api_version = {api_version}
    capabilities = Capabilities(platforms=frozenset({{"cpu"}}), gqa=True, causal=True,
                                differentiable=True, jax_versions={jax_versions!r})
    priority = {{"cpu": 5}}

    def attend(self, call, q, k, v, operands, options=None):
        from _support import dense
        return dense(call, q, k, v, operands)

@hookimpl
def attn_backends_register():
    {body}
'''


def make_dist(
    site: Path,
    dist: str,
    backend: str,
    *,
    version: str = "0.3",
    body: str = "return [B()]",
    prelude: str = "",
    api_version: int = 1,
    jax_versions: str = "",
) -> str:
    """Write distribution ``dist`` offering ``backend`` into ``site``; returns its module name."""
    module = f"throwaway_{backend}_{next(_counter)}"
    source = BACKEND_SOURCE.format(name=backend, body=body, api_version=api_version,
                                   jax_versions=jax_versions)
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(prelude + source)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[attn_backends]\n{backend} = {module}\n")
    return module


def gpu_target() -> Any:
    """A context naming an H100 as the device to lower for (a GPU this machine
    lacks): jax >= 0.12 lowers a Pallas Triton kernel for cuda only for a named GPU."""
    from attn_backends.contract import jax_api

    return jax_api.lowering_for_absent_gpu()


@contextlib.contextmanager
def every_warning_an_error() -> Any:
    """Every warning raises (a backend installed for another jax line, ejkernel_xla
    on jax 0.12, no longer warns at load unless ATTN_BACKENDS_ONLY names it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


#: The repository's examples/ folder.
EXAMPLES = Path(__file__).parents[1] / "examples"


def load_example(path: str, name: str) -> Any:
    """The example script at ``examples/PATH`` imported as module ``name`` (the
    examples are scripts, not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, EXAMPLES / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
