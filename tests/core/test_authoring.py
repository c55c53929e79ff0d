"""attn_backends.authoring, on fake data: the manifest builder, the version fallback,
options resolution, refusal, and the interpret switch with its switched manifest."""

from __future__ import annotations

import dataclasses
from importlib import metadata

import attn_backends
import jax.numpy as jnp
import pytest
from attn_backends import FEATURES, Backend, Capabilities, HeadDims, UnsupportedError
from attn_backends.authoring import (
    UNKNOWN_VERSION,
    InterpretSwitch,
    distribution_version,
    manifest,
    refuse,
    resolve_options,
)

ENV = "ATTN_BACKENDS_TEST_AUTHORING_INTERPRET"
#: The cpu rejection's addition while the switch is off, spelled out once.
OFF_NOTE = (
    f"Fake interpret mode is off: set {ENV}=1 or wrap the call in "
    "attn_backend_fake.interpret_mode() to run the fake kernels emulated on cpu (slow; for tests)"
)


def _call(dtype="float32", **kw):
    q = jnp.zeros((1, 4, 2, 8), dtype)
    return attn_backends.bind(q, q, q, **kw)[0]


@pytest.fixture
def switch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    return InterpretSwitch(ENV, package="attn_backend_fake", kernel="the fake kernels",
                           mode_name="Fake interpret mode")


BASE = manifest(platforms={"tpu"}, features={"causal"}, dtypes=frozenset({"float32"}),
                head_dims=HeadDims(multiple_of=8), differentiable=True, jax_versions=">=0.10")


# manifest ------------------------------------------------------------------


def test_manifest_claims_exactly_the_named_features():
    caps = manifest(platforms=["cpu", "gpu"], features=("gqa", "mask"), differentiable=True)
    assert type(caps) is Capabilities
    assert caps.features == {"gqa", "mask"}
    assert caps.platforms == {"cpu", "gpu"}
    assert caps.differentiable and not caps.bias_grad and caps.deterministic
    assert caps == Capabilities(platforms=frozenset({"cpu", "gpu"}), gqa=True, mask=True,
                                differentiable=True)
    assert manifest(platforms={"tpu"}, features=FEATURES).features == set(FEATURES)
    assert manifest(platforms={"tpu"}).features == set()


def test_manifest_refuses_what_it_cannot_mean():
    with pytest.raises(ValueError, match=r"\['causual'\] are not features"):
        manifest(platforms={"cpu"}, features={"causual"})
    with pytest.raises(TypeError, match=r"name \['causal'\] in features="):
        manifest(platforms={"cpu"}, causal=True)
    with pytest.raises(TypeError, match="features must be a collection of names"):
        manifest(platforms={"cpu"}, features="causal")
    with pytest.raises(TypeError, match="platforms must be a collection of names"):
        manifest(platforms="cpu")
    with pytest.raises(ValueError, match="bias_grad=True needs bias=True"):  # Capabilities' own
        manifest(platforms={"cpu"}, bias_grad=True)


# distribution_version ------------------------------------------------------


def test_version_of_an_installed_distribution():
    assert distribution_version("attn-backends") == metadata.version("attn-backends")
    assert distribution_version("attn-backends", fallback="x") != "x"


def test_version_falls_back_when_not_installed():
    missing = "attn-backend-surely-not-installed-anywhere"
    assert UNKNOWN_VERSION == "0+unknown"
    assert distribution_version(missing) == "0+unknown"
    assert distribution_version(missing, fallback="9.9") == "9.9"


# resolve_options -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeBlocks:
    block: int = 128


FakeBlocks.__module__ = "attn_backend_fake._config"  # where a plugin would define it


def test_options_none_takes_the_default_and_only_then_calls_it():
    calls = []

    def default():
        calls.append(1)
        return FakeBlocks(16)

    assert resolve_options(None, FakeBlocks, default) == FakeBlocks(16)
    assert calls == [1]
    given = FakeBlocks(64)
    assert resolve_options(given, FakeBlocks, default) is given
    assert calls == [1]


def test_options_of_another_type_name_the_public_class():
    with pytest.raises(ValueError) as info:
        resolve_options({"block": 8}, FakeBlocks, FakeBlocks)
    assert str(info.value) == "options: expected attn_backend_fake.FakeBlocks or None, got dict"


# refuse --------------------------------------------------------------------


def test_refuse_raises_only_with_reasons():
    call = _call(causal=True)
    assert refuse("fake", call, []) is None
    with pytest.raises(UnsupportedError) as info:
        refuse("fake", call, ["b is off", "a is off", "b is off"])
    assert str(info.value) == f"fake cannot serve {call.describe()}: b is off; a is off"


# InterpretSwitch -----------------------------------------------------------


def test_switch_reads_the_variable_and_the_block_overrides_it(switch, monkeypatch):
    assert not switch.enabled()
    with switch.mode():
        assert switch.enabled()
        with switch.mode(False):
            assert not switch.enabled()
        assert switch.enabled()
    assert not switch.enabled()
    monkeypatch.setenv(ENV, "1")
    assert switch.enabled()
    with switch.mode(False):
        assert not switch.enabled()
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=ENV):
        switch.enabled()


def test_two_switches_are_independent(switch):
    other = InterpretSwitch(ENV + "_OTHER", package="attn_backend_other", kernel="k",
                            mode_name="m")
    with switch.mode():
        assert switch.enabled() and not other.enabled()


def test_how_to_enable_names_the_variable_and_the_context_manager(switch):
    assert switch.env_var == ENV
    assert switch.how_to_enable == OFF_NOTE.removeprefix("Fake interpret mode is off: ")
    assert switch.off_note == OFF_NOTE


def test_switched_manifest_adds_cpu_only_while_on(switch):
    switched = switch.capabilities(BASE)
    off, on = switched.off, switched.on
    assert off.platforms == {"tpu"} and on.platforms == {"tpu", "cpu"}
    # Otherwise the base manifest, field for field (no field of the switch's own).
    assert off.as_dict() == BASE.as_dict()
    assert on.as_dict() == {**BASE.as_dict(), "platforms": ["cpu", "tpu"]}
    assert isinstance(off, Capabilities) and off == dataclasses.replace(on, platforms={"tpu"})


def test_switched_manifest_reads_the_switch_on_class_and_instance(switch):
    class Fake(Backend):
        name = "fake"
        version = "1"
        capabilities = switch.capabilities(BASE)  # type: ignore[assignment]

        def attend(self, call, q, k, v, operands, options=None):
            raise AssertionError("not called here")

    assert Fake.capabilities.platforms == Fake().capabilities.platforms == {"tpu"}
    with switch.mode():
        assert Fake.capabilities.platforms == Fake().capabilities.platforms == {"tpu", "cpu"}


def test_cpu_rejection_says_how_to_turn_the_switch_on(switch):
    switched = switch.capabilities(BASE)
    call = _call(causal=True)
    assert switched.off.unmet(call, "cpu") == [f"platform 'cpu' not in ['tpu'] ({OFF_NOTE})"]
    assert switched.off.unmet(call, "gpu") == ["platform 'gpu' not in ['tpu']"]
    assert switched.off.unmet(call, "tpu") == [] == switched.on.unmet(call, "cpu")
    # Reasons other than the platform are left as the base manifest gives them.
    f16 = _call("float16", window=(1, 0))
    assert switched.off.unmet(f16, "cpu")[1:] == BASE.unmet(f16, "cpu")[1:] != []
    assert switched.on.unmet(f16, "cpu") == BASE.unclaimed(f16)
    # dataclasses.replace keeps the note (it is the class's, not a field).
    replaced = dataclasses.replace(switched.off, dtypes=frozenset({"bfloat16"}))
    assert replaced.unmet(call, "cpu")[0].endswith(f"({OFF_NOTE})")


def test_the_base_manifest_must_leave_cpu_to_the_switch(switch):
    with pytest.raises(ValueError, match="the base manifest lists cpu"):
        switch.capabilities(dataclasses.replace(BASE, platforms=frozenset({"cpu", "tpu"})))


def test_registry_serves_cpu_only_while_the_switch_is_on(switch, fake_registry):
    class Emulated(Backend):
        name = "emulated"
        version = "1"
        capabilities = switch.capabilities(BASE)  # type: ignore[assignment]

        def attend(self, call, q, k, v, operands, options=None):
            return q * 2.0

    registry = fake_registry(Emulated())
    attention = registry.get(device="cpu", backend="emulated")
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(UnsupportedError, match="Fake interpret mode is off: set " + ENV):
        attention(q, q, q, causal=True)
    with switch.mode():
        assert float(registry.get(device="cpu", backend="emulated")(q, q, q, causal=True)
                     .sum()) == 128.0
