"""On a jax line outside ejkernel's pin (jax~=0.10.0), ejkernel_xla is refused by its
manifest's jax range, with that reason in explain, and nothing imports ejkernel."""

from __future__ import annotations

import attn_backends as ab
import jax
import pytest
from attn_backend_ejkernel._plugin import JAX_VERSIONS
from attn_backends.contract.capabilities import in_range

pytestmark = pytest.mark.skipif(
    in_range(jax.__version__, JAX_VERSIONS),
    reason=f"jax {jax.__version__} is inside ejkernel's range {JAX_VERSIONS}: the compatibility "
           "run tests the backend there (test_ejkernel_xla.py)")

REASON = f"jax {jax.__version__} is outside the supported range {JAX_VERSIONS}"


def test_explain_says_the_jax_range_refuses_it() -> None:
    registry = ab.Registry()
    q = jax.ShapeDtypeStruct((1, 8, 2, 16), "float32")
    exp = registry.get(device="cpu").explain(q, q, q, causal=True)
    verdict = next(v for v in exp.verdicts if v.backend == "ejkernel_xla")
    assert verdict.reasons == (REASON,)
    assert exp.chosen not in (None, "ejkernel_xla")
    strict = registry.get(device="cpu", backend="ejkernel_xla", fallback="error")
    with pytest.raises(ab.UnsupportedError, match=REASON.replace(".", r"\.")):
        jax.eval_shape(lambda q: strict(q, q, q, causal=True), q)


def test_loading_says_nothing_and_list_names_the_refusal(capsys) -> None:
    # (Named in ATTN_BACKENDS_ONLY, loading warns: tests/core/test_discovery.py.)
    import warnings

    from attn_backends_cli.main import main

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a user of other backends sees no warning
        assert "ejkernel_xla" in ab.Registry().backends
    assert main(["list"]) == 0
    assert f"never selected here:\n  - ejkernel_xla: {REASON}" in capsys.readouterr().out
