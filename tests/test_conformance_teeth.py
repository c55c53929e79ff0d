"""The conformance suite has teeth: each deliberately broken backend fails, for its reason.

A dense, correct jnp backend (``Dense``) is written here, independent of the
plugins; each broken variant overrides one small piece of it. The suite runs
in-process (``run_check`` with a Backend instance, ``--attn-quick``) and the
certificate says which tests and case families failed. The correct one runs
the whole quick table and must pass, as must the installed ``example_dense``
backend; a broken one runs the families it must fail and those it must pass
(``--attn-only``), which keeps twelve-odd runs within the CPU budget.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_backends import AttentionCall, Backend, Capabilities, HeadDims, Operands
from attn_backends_contracts import run_check
from attn_backends_contracts.cases import TABLES

#: Started early under make test's two workers, by its seconds there (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=65)

_FULL = Capabilities(
    platforms=frozenset({"cpu"}), dtypes=frozenset({"float32", "bfloat16"}),
    head_dims=HeadDims(allowed=frozenset({16})), gqa=True, causal=True, window=True,
    segment_ids=True, lengths=True, mask=True, bias=True, bias_grad=True, softcap=True,
    return_lse=True, differentiable=True, deterministic=True,
)


class Dense(Backend):
    """Correct dense attention; the methods are the seams the broken variants bend."""

    name = "teeth_dense"
    version = "0"
    capabilities = _FULL

    def scale(self, call: AttentionCall) -> float:
        return call.scale

    def kv_head(self, call: AttentionCall) -> np.ndarray:
        # numpy, so the index is a constant: variants that do not touch it
        # lower to the same program and share compiled executables.
        return np.arange(call.q_heads) // call.group

    def visible(self, call: AttentionCall, ops: Operands) -> jax.Array:
        i = jnp.arange(call.q_len)[:, None] + call.offset
        j = jnp.arange(call.kv_len)[None, :]
        vis = jnp.ones((1, 1, call.q_len, call.kv_len), bool)
        if call.causal:
            vis &= j <= i
        if call.window is not None:
            left, right = call.window
            vis &= (j >= i - left) if left is not None else True
            vis &= (j <= i + right) if right is not None else True
        if ops.q_segment_ids is not None:
            vis &= (ops.q_segment_ids[:, :, None] == ops.kv_segment_ids[:, None, :])[:, None]
        if ops.kv_lengths is not None:
            vis &= (j[None] < ops.kv_lengths[:, None, None])[:, None]
        if ops.q_lengths is not None:
            rows = jnp.arange(call.q_len)[None, :, None]
            vis &= (rows < ops.q_lengths[:, None, None])[:, None]
        if ops.mask is not None:
            vis &= ops.mask
        return vis

    def logits(self, call: AttentionCall, s: jax.Array, bias: Any) -> jax.Array:
        if call.softcap is not None:
            s = call.softcap * jnp.tanh(s / call.softcap)
        return s if bias is None else s + bias.astype(jnp.float32)

    def softmax(self, s: jax.Array, vis: jax.Array) -> tuple[jax.Array, jax.Array]:
        seen = vis.any(-1, keepdims=True)
        top = jnp.where(vis, s, -jnp.inf).max(-1, keepdims=True)
        top = jax.lax.stop_gradient(jnp.where(seen, top, 0.0))
        e = jnp.where(vis, jnp.exp(jnp.where(vis, s - top, 0.0)), 0.0)
        total = jnp.where(seen, e.sum(-1, keepdims=True), 1.0)
        lse = jnp.where(seen, top + jnp.log(total), -jnp.inf)[..., 0]
        return e / total, lse

    def finish(self, out: jax.Array, q: jax.Array) -> jax.Array:
        return out.astype(q.dtype)

    def attend(self, call: AttentionCall, q: Any, k: Any, v: Any, ops: Operands,
               options: Any = None) -> Any:
        hi = jax.lax.Precision.HIGHEST
        kh, vh = k[:, :, self.kv_head(call)], v[:, :, self.kv_head(call)]
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kh.astype(jnp.float32),
                       precision=hi) * self.scale(call)
        s = self.logits(call, s, ops.bias)
        vis = jnp.broadcast_to(self.visible(call, ops), s.shape)
        p, lse = self.softmax(s, vis)
        out = self.finish(jnp.einsum("bhqk,bkhd->bqhd", p, vh.astype(jnp.float32),
                                     precision=hi), q)
        return (out, lse) if call.return_lse else out


class CausalIgnored(Dense):
    name = "teeth_causal_ignored"

    def visible(self, call, ops):
        return super().visible(replace(call, causal=False), ops)


class CausalTopLeft(Dense):
    name = "teeth_causal_top_left"

    def visible(self, call, ops):
        vis = super().visible(replace(call, causal=False), ops)
        top_left = jnp.arange(call.kv_len)[None] <= jnp.arange(call.q_len)[:, None]
        return vis & top_left if call.causal else vis


class SegmentsIgnored(Dense):
    name = "teeth_segments_ignored"

    def visible(self, call, ops):
        return super().visible(call, ops._replace(q_segment_ids=None, kv_segment_ids=None))


class ScaleOneOverD(Dense):
    name = "teeth_scale_one_over_d"

    def scale(self, call):
        return 1.0 / call.head_dim


class ScaleOffByOnePerMille(Dense):
    """The logit scale 0.1% high: the ``same_sign`` family's large logits show it."""

    name = "teeth_scale_off_1e-3"

    def scale(self, call):
        return call.scale * (1 + 1e-3)


class NanOnEmptyRows(Dense):
    name = "teeth_nan_empty_rows"

    def softmax(self, s, vis):
        p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1)
        return p, jax.nn.logsumexp(jnp.where(vis, s, -jnp.inf), axis=-1)


class GqaModulo(Dense):
    name = "teeth_gqa_modulo"

    def kv_head(self, call):
        return np.arange(call.q_heads) % call.kv_heads


class BiasNoGrad(Dense):
    name = "teeth_bias_no_grad"

    def logits(self, call, s, bias):
        return super().logits(call, s, None if bias is None else jax.lax.stop_gradient(bias))


class SoftcapAfterBias(Dense):
    name = "teeth_softcap_after_bias"

    def logits(self, call, s, bias):
        s = s if bias is None else s + bias.astype(jnp.float32)
        return s if call.softcap is None else call.softcap * jnp.tanh(s / call.softcap)


class UpcastOutput(Dense):
    name = "teeth_upcast_output"

    def finish(self, out, q):
        return out


class BlockTail(Dense):
    """Loses the keys of a last, partial block of 16 (a padding bug)."""

    name = "teeth_block_tail"

    def visible(self, call, ops):
        vis = super().visible(call, ops)
        if call.kv_len % 16:
            vis &= jnp.arange(call.kv_len) < (call.kv_len // 16) * 16
        return vis


class WindowIgnored(Dense):
    name = "teeth_window_ignored"

    def visible(self, call, ops):
        return super().visible(replace(call, window=None), ops)


class TraceDependent(Dense):
    """Claims determinism, but each trace bakes in a different constant."""

    name = "teeth_trace_dependent"
    _traces = itertools.count()

    def finish(self, out, q):
        return (out * (1 + 1e-6 * next(self._traces))).astype(q.dtype)


class MarkerMissing(Dense):
    name = "teeth_marker_missing"
    hlo_marker = "teeth_custom_kernel"


# backend class -> (what must fail, what must pass), each a set of
# "family" or "test:case-id" strings read from the certificate.
BROKEN = {
    CausalIgnored: ({"causal", "mask_effect"}, {"shapes", "window"}),
    CausalTopLeft: ({"test_forward:causal-q7k19-float32"},
                    {"test_forward:causal-q17k17-float32", "shapes"}),
    SegmentsIgnored: ({"segment_ids"}, {"shapes", "causal"}),
    ScaleOneOverD: ({"shapes"}, {"unclaimed"}),
    ScaleOffByOnePerMille: ({"test_forward:same_sign-q256k8-b2-float32",
                             "test_gradients:same_sign-q256k8-b2-float32"}, {"unclaimed"}),
    NanOnEmptyRows: ({"masked_rows"}, {"shapes", "gqa"}),
    GqaModulo: ({"gqa"}, {"shapes", "causal"}),
    BiasNoGrad: ({"test_gradients:bias-full-float32"}, {"test_forward:bias-full-float32"}),
    SoftcapAfterBias: ({"test_forward:combined-softcap+bias-float32"},
                       {"softcap", "bias"}),
    UpcastOutput: ({"output_dtype"}, {"test_forward:shapes-q17k17-float32"}),
    BlockTail: ({"test_forward:shapes-q17k17-float32"},
                {"test_forward:shapes-q16k32b2-float32"}),
    WindowIgnored: ({"window", "mask_effect"}, {"shapes", "causal"}),
    # Every trace of it is a new program (none shared with Dense's runs): its
    # passing family is a small one.
    TraceDependent: ({"determinism"}, {"softcap"}),
    MarkerMissing: ({"hlo"}, {"shapes", "transforms"}),
}

_QUICK = ["--attn-quick", "-q", "-p", "no:cacheprovider"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTN_BACKENDS_CACHE_DIR", str(tmp_path / "cache"))


def cert_family(key: str) -> str:
    """The family of a "test:family-case-dtype" key."""
    case_id = key.split(":", 1)[1]
    return next(f for f in TABLES if case_id.startswith(f + "-"))


def _certify(backend: Any, tmp_path: Path, extra: list[str] = ()) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "certificate.json"
    code = run_check(backend, str(path), [*_QUICK, *extra])
    return code, json.loads(path.read_text())


def _failed(cert: dict[str, Any]) -> set[str]:
    out = set()
    for f in cert["failures"]:
        out.add(f["family"])
        if f["case"]:
            out.add(f"{f['test']}:{f['case']}")
    return out


def test_correct_dense_backend_passes(tmp_path: Path) -> None:
    code, cert = _certify(Dense(), tmp_path)
    assert code == 0, cert["failures"]
    assert cert["passed"] and cert["cases"]["failed"] == 0 and cert["cases"]["passed"] > 20
    assert cert["backend"] == "teeth_dense" and cert["mode"] == "quick"


@pytest.mark.parametrize("broken", list(BROKEN), ids=lambda cls: cls.name)
def test_broken_backend_fails_for_its_reason(broken: type[Dense], tmp_path: Path) -> None:
    must_fail, must_pass = BROKEN[broken]
    families = {x for x in must_fail | must_pass if ":" not in x}
    families |= {cert_family(x) for x in must_fail | must_pass if ":" in x}
    code, cert = _certify(broken(), tmp_path, ["--attn-only=" + ",".join(sorted(families))])
    failed = _failed(cert)
    assert code != 0 and not cert["passed"]
    assert must_fail <= failed, f"expected failures {must_fail}, got {sorted(failed)}"
    assert not must_pass & failed, f"{must_pass & failed} failed but should pass"


def test_installed_example_backend_passes(tmp_path: Path) -> None:
    pytest.importorskip("attn_backend_example_dense")
    path = tmp_path / "example.json"
    code = run_check("example_dense", str(path), _QUICK)
    cert = json.loads(path.read_text())
    assert code == 0, cert["failures"]
    assert cert["passed"] and cert["backend"] == "example_dense"
    stored = list((tmp_path / "cache" / "certificates").glob("example_dense-*.json"))
    assert len(stored) == 1, "run_check stores the certificate of an installed backend"


class RaisesOnOneShape(Dense):
    """Right everywhere but one query length, where tracing raises."""

    name = "teeth_raises_on_one_shape"

    def attend(self, call, q, k, v, ops, options=None):
        if call.q_len == 37:
            raise RuntimeError("teeth: no kernel for Tq=37")
        return super().attend(call, q, k, v, ops, options)


def test_a_case_that_raises_inside_a_batch_fails_alone(tmp_path: Path) -> None:
    """The suite compiles its cases in batches; an error in one fails that case
    only, with its own message, and its batch-mates still pass."""
    path = tmp_path / "certificate.json"
    code = run_check(RaisesOnOneShape(), str(path), ["-q", "-p", "no:cacheprovider",
                                                     "--attn-only=shapes"])
    cert = json.loads(path.read_text())
    assert code != 0
    assert {(f["test"], f["case"]) for f in cert["failures"]} == {
        ("test_forward", "shapes-q37k1-float32"), ("test_gradients", "shapes-q37k1-float32")}
    assert all("no kernel for Tq=37" in f["message"] for f in cert["failures"])
    assert cert["cases"]["passed"] >= 2 * 7  # the other seven shapes, forward and gradients


class IdsOnly(Dense):
    """Correct, claiming segment ids but not masks: key masks reach it as segment ids."""

    name = "teeth_ids_only"
    capabilities = replace(_FULL, mask=False)


def _ids_forgotten(call: AttentionCall, ops: Operands) -> Operands:
    """A rewrite that drops the call's own segment ids."""
    from attn_backends.choose import dispatch

    return dispatch._key_mask_rewrite(call, ops._replace(q_segment_ids=None,
                                                         kv_segment_ids=None))


def _masked_keys_visible(call: AttentionCall, ops: Operands) -> Operands:
    """A rewrite that gives masked keys the visible id."""
    from attn_backends.choose import dispatch

    return dispatch._key_mask_rewrite(call, ops._replace(mask=jnp.ones_like(ops.mask)))


def test_key_mask_cases_certify_the_rewrite_to_segment_ids(tmp_path: Path) -> None:
    code, cert = _certify(IdsOnly(), tmp_path, ["--attn-only=key_mask"])
    assert code == 0, cert["failures"]
    assert cert["cases"]["passed"] >= 6 and {f["family"] for f in cert["failures"]} == set()


@pytest.mark.parametrize("mutant", [_ids_forgotten, _masked_keys_visible],
                         ids=lambda m: m.__name__.strip("_"))
def test_a_broken_rewrite_fails_the_key_mask_family(mutant: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from attn_backends.choose import dispatch

    monkeypatch.setattr(dispatch, "_key_mask_rewrite", dispatch.key_mask_as_segment_ids,
                        raising=False)
    monkeypatch.setattr(dispatch, "key_mask_as_segment_ids", mutant)
    code, cert = _certify(IdsOnly(), tmp_path, ["--attn-only=key_mask"])
    failed = _failed(cert)
    assert code != 0 and "key_mask" in failed
    if mutant is _masked_keys_visible:  # every quick case hides keys
        assert {"test_forward:key_mask-b2-float32",
                "test_forward:key_mask-empty-example-b3-float32"} <= failed
    else:  # only the case with segment ids of its own
        assert {k for k in failed if k.startswith("test_forward:")} == {
            "test_forward:key_mask-segments-empty-b3-float32"}
