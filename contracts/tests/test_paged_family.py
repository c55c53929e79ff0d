"""The ``paged`` family's cases follow the paged manifest, and a backend without
paged support has the family skipped as not applicable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attn_backends as ab
import pytest
from attn_backends_contracts import paged_cases, run_check


def _backend(interpret: bool = False, **paged: Any) -> Any:
    class Fake(ab.Backend, ab.PagedBackend):
        name = "fake_paged"
        version = "1.0"
        capabilities = ab.Capabilities(platforms={"tpu", "cpu"}, interpret=interpret)
        paged_capabilities = ab.PagedCapabilities(platforms={"tpu", "cpu"}, **paged)

        def attend(self, call, q, k, v, operands, options=None):  # type: ignore[no-untyped-def]
            raise AssertionError("not called")

        def attend_paged(self, call, q, cache, batch, options=None):  # type: ignore[no-untyped-def]
            raise AssertionError("not called")

    return Fake()


def test_paged_cases_follow_the_paged_manifest() -> None:
    backend = _backend(dtypes={"bfloat16"}, page_sizes={16, 64, 128}, gqa=True,
                       head_dims=ab.HeadDims(allowed={64, 128}))
    cases = paged_cases.paged_cases_for(backend)
    assert cases and all(c.dtype == "bfloat16" for c in cases)
    assert all(c.softcap is None and c.window is None for c in cases)
    assert {c.page_size for c in cases} == {16, 64, 128}  # the smallest, then two sweeps
    assert {c.head_dim for c in cases} == {64, 128}
    smallest = [c for c in cases if c.page_size == 16 and c.head_dim == 64]
    assert {kv for c in smallest if c.name.startswith("kv") for _, kv in c.seqs} == {
        1, 15, 16, 17, 50}
    assert {(c.q_heads, c.kv_heads) for c in smallest} >= {(2, 2), (4, 2), (8, 2), (16, 2),
                                                           (4, 1)}
    assert any(c.kind == "same_seq" for c in cases)
    unclaimed = dict(paged_cases.paged_unclaimed(backend))
    assert paged_cases.paged_unclaimed(backend) == [
        ("feature", "softcap"), ("feature", "window"), ("dtype", "float16"),
        ("dtype", "float32"), ("dtype", "float64"), ("page_size", "1"), ("head_dim", "1"),
        ("kv_dtype", "int8"), ("kv_dtype", "float8_e4m3fn"),
        ("kv_dtype", "float8_e5m2"), ("gradient", "q")]
    assert unclaimed["page_size"] == "1"
    assert not any(c.kv_dtype for c in cases)  # it claims no quantized cache


def test_quantized_cases_follow_the_claimed_kv_dtypes() -> None:
    backend = _backend(dtypes={"float32", "bfloat16"}, gqa=True, window=True, softcap=True,
                       kv_dtypes={"int8", "float8_e5m2"})
    cases = [c for c in paged_cases.paged_cases_for(backend) if c.kv_dtype]
    assert {c.family for c in cases} == {"quantized"}
    assert {(c.kv_dtype, c.dtype) for c in cases} == {
        ("int8", "float32"), ("int8", "bfloat16"), ("float8_e5m2", "float32"),
        ("float8_e5m2", "bfloat16")}
    names = {c.name for c in cases if c.kv_dtype == "int8" and c.dtype == "float32"}
    assert names == set(paged_cases.QUANTIZED_SWEEP)
    # Another cache dtype takes the same path with another element type: two cases.
    assert {c.name for c in cases if c.kv_dtype == "float8_e5m2" and c.dtype == "float32"} \
        == {"mixed", "decode-max-q-len-1"}
    assert cases[0].id == "quantized-mixed-float32-int8"
    quick = [c for c in paged_cases.paged_cases_for(backend, quick=True) if c.kv_dtype]
    assert {c.name for c in quick} == {"mixed", "decode-max-q-len-1"}
    stores = [c for c in paged_cases.paged_dtypes(backend) if c.kv_dtype]
    assert [(c.kv_dtype, c.dtype) for c in stores] == [("float8_e5m2", "float32"),
                                                          ("int8", "float32")]
    assert ("kv_dtype", "float8_e4m3fn") in paged_cases.paged_unclaimed(backend)


def test_a_decode_only_manifest_gets_every_case_cut_to_its_max_q_len() -> None:
    backend = _backend(max_q_len=1, gqa=True, window=True, softcap=True)
    cases = paged_cases.paged_cases_for(backend)
    assert cases and all(c.max_q_len == 1 for c in cases)
    assert all(q <= 1 for c in cases for q, _ in c.seqs)
    assert ("max_q_len", "2") in paged_cases.paged_unclaimed(backend)


def test_an_emulated_backend_runs_the_reduced_table() -> None:
    fast, slow = _backend(interpret=True, gqa=True), _backend(gqa=True)
    assert paged_cases.emulated(fast, "cpu") and not paged_cases.emulated(fast, "tpu")
    assert not paged_cases.emulated(slow, "cpu")
    full = paged_cases.paged_cases_for(slow)
    reduced = paged_cases.paged_cases_for(fast, quick=True)
    assert 0 < len(reduced) <= 12 < len(full)
    assert {c.name for c in reduced} >= {"mixed", "same-seq-twice", "gqa-h8kv2"}


def test_a_backend_without_paged_support_skips_the_family(tmp_path: Path) -> None:
    pytest.importorskip("attn_backend_reference")
    from attn_backend_reference._dense import dense_attention

    class DenseOnly(ab.Backend):
        name = "dense_only"
        version = "1.0"
        capabilities = ab.Capabilities(platforms={"cpu"})

        def attend(self, call, q, k, v, operands, options=None):  # type: ignore[no-untyped-def]
            return dense_attention(call, q, k, v, operands)

    path = tmp_path / "cert.json"
    code = run_check(DenseOnly(), str(path), ["--attn-only=paged,paged_unclaimed", "-q",
                                              "-p", "no:cacheprovider"])
    cert = json.loads(path.read_text())
    assert code == 0 and not cert["failures"]
    assert cert["families"]["paged"] == {"-": {"skipped": 4}}  # one per test of the family
    assert cert["families"]["paged_unclaimed"] == {"-": {"skipped": 1}}
    assert cert["cases"]["run"] == 0


def test_a_case_check_paged_declines_is_skipped_with_its_reason(tmp_path: Path) -> None:
    pytest.importorskip("attn_backend_reference")
    from attn_backend_reference._plugin import ReferenceBackend

    class Picky(ReferenceBackend):
        name = "picky"

        def check_paged(self, call: Any) -> list[str]:
            return ["no windows on Tuesdays"] if call.window is not None else []

    path = tmp_path / "cert.json"
    code = run_check(Picky(), str(path), [
        "--attn-only=paged", "-q", "-p", "no:cacheprovider", "-k",
        "test_paged_matches_oracle and (paged-window-p-float32 or paged-kv5-float32)"])
    cert = json.loads(path.read_text())
    assert code == 0 and not cert["failures"], cert["failures"]
    assert cert["cases"] == {"run": 2, "passed": 1, "failed": 0, "skipped": 1}


def _call(case: Any) -> Any:
    """The case's PagedCall, bound as ``get_paged`` binds it (no registry, no probe)."""
    from attn_backends.contract.paged_bind import bind_paged

    return bind_paged(**case.call_args())


def test_a_case_the_manifest_declines_here_runs_as_its_decode_step() -> None:
    """A manifest serving only bfloat16 decode steps on cpu (flash_pallas' emulated
    kernel): each declined case becomes its decode step in bfloat16; a same_seq case,
    and one whose decode step is declined too (a window), stay, to be skipped."""

    class DecodeOnBf16Here(ab.PagedCapabilities):
        def unmet(self, call: Any, platform: str) -> list[str]:
            extra = [] if platform != "cpu" or (call.max_q_len == 1 and call.dtype == "bfloat16"
                                                and call.window is None) else ["emulated: no"]
            return super().unmet(call, platform) + extra

    backend = _backend()
    backend.paged_capabilities = DecodeOnBf16Here(platforms={"tpu", "cpu"}, gqa=True,
                                                  window=True, softcap=True,
                                                  dtypes={"float32", "bfloat16"})
    cases = paged_cases.paged_cases_for(backend) + paged_cases.paged_dtypes(backend)
    served = paged_cases.as_served(cases, backend, "cpu", _call)
    by_id = {c.id: c for c in served}
    mixed = next(c for c in cases if c.name == "mixed" and c.dtype == "float32")
    step = by_id["paged-mixed-as-decode-bfloat16"]
    assert step.max_q_len == 1 and step.seqs == tuple((min(q, 1), kv) for q, kv in mixed.seqs)
    assert (step.num_seqs, step.pad_rows, step.order) == (mixed.num_seqs, mixed.pad_rows,
                                                          mixed.order)
    assert {0, 1} == {q for q, _ in step.seqs}  # a sequence without new rows keeps none
    assert "paged-window-p-float32" in by_id and "paged-same-seq-twice-float32" in by_id
    assert "paged-store-as-decode-bfloat16" in by_id
    # The float32 and bfloat16 "mixed" share one step: it runs once.
    assert len(served) == len(by_id)
    assert not [c for c in served if c.kind != "same_seq" and c.window is None
                and not c.name.endswith("-as-decode")]
    # Where the manifest serves every case, nothing changes.
    assert paged_cases.as_served(cases, backend, "tpu", _call) == cases
