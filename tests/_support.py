"""Helpers for the repo's own tests: in-process fake backends and arrays."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attn_backends as ab
from attn_backends import Backend, Capabilities, hookimpl

ALL_FEATURES = dict(
    gqa=True, causal=True, window=True, segment_ids=True, lengths=True, mask=True,
    bias=True, bias_grad=True, softcap=True, return_lse=True, differentiable=True,
)


def dense(call: ab.AttentionCall, q: Any, k: Any, v: Any, ops: ab.Operands) -> Any:
    """The reference backend's math, used by fakes that must compute something."""
    from attn_backend_reference._dense import dense_attention

    return dense_attention(call, q, k, v, ops)


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
        from attn_backend_reference._dense import dense_attention
        return dense_attention(call, q, k, v, operands)

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
