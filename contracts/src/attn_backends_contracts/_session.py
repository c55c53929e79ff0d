"""The suite's state for one pytest session: the backend under test and its results.

Created only when the suite runs (``--attn-backend``, ``--attn-backend-object``
or an in-process provider from :func:`attn_backends_contracts.run_check`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from attn_backends.authoring import CLAIMABLE_DTYPES, PLATFORMS, QUANTIZED_KV_DTYPES
from attn_backends.contract.environment import platform_name

from ._inputs import wide, x64_for
from .cases import Case, cases_for, make_inputs

F = TypeVar("F", bound=Callable[..., Any])


#: Numeric cases compiled together as one program (see :func:`._runner.run_cases`).
BATCH_SIZE = 16

SUITE_KEY = pytest.StashKey["Suite | None"]()


def family(name: str) -> Callable[[F], F]:
    """Tag a suite test function with the case family it reports under."""

    def tag(fn: F) -> F:
        fn._attn_family = name  # type: ignore[attr-defined]
        return fn

    return tag


def _plugin_for(backend: Any) -> object:
    """An in-process plugin object whose hook registers ``backend``."""
    import attn_backends

    class InProcessPlugin:
        __name__ = f"attn-backends-contracts:{backend.name}"

        @attn_backends.hookimpl
        def attn_backends_register(self) -> list[Any]:
            return [backend]

    return InProcessPlugin()


def load_object(spec: str) -> Any:
    """``module:attr`` or ``path/to/file.py:attr`` -> a Backend instance.

    ``attr`` may be a Backend instance, a Backend subclass (instantiated) or a
    callable returning one.
    """
    import attn_backends

    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise pytest.UsageError(
            f"--attn-backend-object: expected 'module:attr' or 'file.py:attr', got {spec!r}"
        )
    if where.endswith(".py"):
        path = Path(where).resolve()
        module_spec = importlib.util.spec_from_file_location(f"_attn_object_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise pytest.UsageError(f"--attn-backend-object: cannot load {where!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    obj = getattr(module, attr)
    if isinstance(obj, type) and issubclass(obj, attn_backends.Backend):
        obj = obj()
    elif not isinstance(obj, attn_backends.Backend) and callable(obj):
        obj = obj()
    if not isinstance(obj, attn_backends.Backend):
        raise pytest.UsageError(
            f"--attn-backend-object: {spec!r} is a {type(obj).__name__}, expected an "
            "attn_backends.Backend instance, subclass or factory"
        )
    return obj


def local_platform() -> str:
    """The contract's name of JAX's default platform here."""
    import jax

    return platform_name(jax.default_backend())


class Suite:
    """The backend under test, how it is called, its cases, and what happened.

    ``attention`` is ``Registry(plugins=[backend]).get(device=platform,
    backend=name, fallback="error")`` with ``probe=None``: the registry path
    model code takes, strict, without other backends or probes; a ``tiles``
    case runs through the same path with ``backend_options`` set to the
    backend's ``tile_small_options(call)``. ``records``
    holds one dict per test (outcome, family, case, dtype, message);
    ``worst`` the largest normalised error per dtype and output.
    """

    def __init__(self, backend: Any, *, source: str, platform: str, quick: bool,
                 only: list[str] | None = None, distribution: str | None = None):
        import attn_backends

        self.backend = backend
        self.distribution = distribution
        self.caps = backend.capabilities
        self.source = source
        self.platform = platform
        self.quick = quick
        self.only = only
        if platform not in self.caps.platforms:
            raise pytest.UsageError(
                f"backend {backend.name!r} does not claim platform {platform!r} (it claims "
                f"{sorted(self.caps.platforms)}): run the suite where JAX sees one of those, "
                "or pass --attn-device"
            )
        # No probe: the suite judges the backend itself, case by case; a probe
        # quarantine would turn every verdict into the same UnsupportedError.
        self.registry = attn_backends.Registry(
            plugins=[_plugin_for(backend)], autoload=False, probe=None
        )
        self.attention = self.attention_on(platform)
        self._tiled: dict[str, Any] = {}
        self.cases: list[Case] = [c for c in cases_for(self.caps, quick=quick)
                                  if not c.tiles or self.tile_options(c) is not None]
        # The case families the full table draws for this manifest: a quick
        # certificate says by them which families it left out as not sampled
        # and which the manifest does not claim (attn-backends matrix).
        self.full_table_families = sorted({c.family for c in cases_for(self.caps)})
        self.records: list[dict[str, Any]] = []
        self.worst: dict[str, dict[str, float]] = {}
        self.certificate: dict[str, Any] | None = None
        self.certificate_path: str | None = None
        self._outcomes: dict[str, Any] = {}
        self._planned: list[Case] = []

    def attention_on(self, platform: str, options: Any = None) -> Any:
        backend_options = None if options is None else {self.backend.name: options}
        return self.registry.get(device=platform, backend=self.backend.name, fallback="error",
                                 backend_options=backend_options)

    def _call(self, case: Case) -> Any:
        import attn_backends

        data = make_inputs(case)
        with x64_for(case.dtype):
            call, _ = attn_backends.bind(data["q"], data["k"], data["v"],
                                         return_lse=case.return_lse, **data["kwargs"])
        # As the registry hands it to the backend (a key mask as segment ids).
        return self.caps.served_call(call)

    def tile_options(self, case: Case) -> Any:
        """The backend's ``tile_small_options`` for ``case``'s call (None: no tiles twin)."""
        return self.backend.tile_small_options(self._call(case))

    def attention_for(self, case: Case) -> Any:
        """The callable ``case`` runs through: default options, or small tiles."""
        if not case.tiles:
            return self.attention
        options = self.tile_options(case)
        key = repr(options)
        if key not in self._tiled:
            self._tiled[key] = self.attention_on(self.platform, options)
        return self._tiled[key]

    @property
    def primary_dtype(self) -> str:
        return "float32" if "float32" in self.caps.dtypes else sorted(self.caps.dtypes)[0]

    def declined(self, case: Case) -> list[str]:
        """Reasons the backend's ``check(call)`` gives for not serving ``case``.

        A case the manifest allows but ``check`` declines (say Dv != D) is
        skipped with these reasons, shown in the summary and certificate.
        """
        return [str(r) for r in self.backend.check(self._call(case))]

    def plan(self, cases: list[Case]) -> None:
        """The numeric cases this run will ask :meth:`outcome` for, in order
        (after ``-k`` and ``--attn-only``): they are compiled in batches."""
        self._planned = list({c.id: c for c in cases}.values())

    def _batch_for(self, case: Case) -> list[Case]:
        """``case`` and the next planned cases not yet run nor declined, up to BATCH_SIZE."""
        batch = [case]
        start = self._planned.index(case) + 1 if case in self._planned else len(self._planned)
        for other in self._planned[start:]:
            if len(batch) == BATCH_SIZE:
                break
            # One x64 setting per batch (run_cases): float64 cases batch apart.
            if (other.id not in self._outcomes and wide(other.dtype) == wide(case.dtype)
                    and not self.declined(other)):
                batch.append(other)
        return batch

    def outcome(self, case: Case) -> Any:
        """The :class:`~._runner.Outcome` of ``case``, computed once (errors re-raised).

        Computed together with the next planned cases in one program; when
        that batch raises, each of its cases runs alone so the error belongs
        to the case that raised it.
        """
        from ._runner import run_cases

        if case.id not in self._outcomes:
            batch = self._batch_for(case)
            results: list[Any]
            try:
                results = run_cases([(self.attention_for(c), c) for c in batch], self.caps,
                                    platform=self.platform)
            except Exception as exc:  # noqa: BLE001 - re-raised by every test of its case
                results = [exc] if len(batch) == 1 else [self._alone(c) for c in batch]
            for c, result in zip(batch, results, strict=True):
                self._outcomes[c.id] = result
        result = self._outcomes[case.id]
        if isinstance(result, Exception):
            raise result
        return result

    def _alone(self, case: Case) -> Any:
        """``case`` in a program of its own: its Outcome, or the exception it raised."""
        from ._runner import run_case

        try:
            return run_case(self.attention_for(case), self.caps, case, platform=self.platform)
        except Exception as exc:  # noqa: BLE001 - re-raised by every test of the case
            return exc

    def unclaimed(self) -> list[tuple[str, str]]:
        """(kind, value) the manifest does not claim: features, dtypes, platforms,
        quantized K and V dtypes, a head dim it rejects, and gradients it does
        not implement."""
        import attn_backends

        caps = self.caps
        out = [("feature", f) for f in attn_backends.FEATURES if f not in caps.features]
        out += [("dtype", d) for d in sorted(CLAIMABLE_DTYPES - caps.dtypes)]
        out += [("platform", p) for p in sorted(PLATFORMS - caps.platforms)]
        out += [("kv_dtype", d) for d in QUANTIZED_KV_DTYPES
                if d not in caps.kv_dtypes]
        rejected = next((d for d in range(1, 4097) if caps.head_dims.reasons(d, "d")), None)
        if rejected is not None:
            out.append(("head_dim", str(rejected)))
        if not caps.differentiable:
            out.append(("gradient", "qkv"))
        elif caps.bias and not caps.bias_grad:
            out.append(("gradient", "bias"))
        return out

    def masking(self) -> list[str]:
        """Claimed features that hide keys: each must change the output."""
        return [f for f in ("causal", "window", "segment_ids", "lengths", "mask")
                if f in self.caps.features]

    def note_errors(self, dtype: str, errors: dict[str, float]) -> None:
        worst = self.worst.setdefault(dtype, {})
        for name, value in errors.items():
            worst[name] = max(worst.get(name, 0.0), value)


def resolve(config: pytest.Config) -> Suite | None:
    """The session's :class:`Suite`, created on first use; None when not asked for."""
    key = SUITE_KEY
    if key in config.stash:
        return config.stash[key]
    name = config.getoption("attn_backend", None)
    spec = config.getoption("attn_backend_object", None)
    provided = [p for p in config.pluginmanager.get_plugins()
                if getattr(p, "attn_backend_provided", None) is not None]
    suite = None
    if provided or name or spec:
        import attn_backends

        distribution = None  # the installed distribution that serves it, when there is one
        if provided:
            backend, source = provided[0].attn_backend_provided, "in-process"
        elif spec:
            backend, source = load_object(spec), f"object {spec}"
        else:
            backend, source = attn_backends.registry.backend(name), "installed"
            distribution = attn_backends.registry.origins[name].distribution
        if name and backend.name != name:
            raise pytest.UsageError(
                f"--attn-backend={name!r} but the given object is backend {backend.name!r}"
            )
        platform = config.getoption("attn_device", None) or local_platform()
        only = config.getoption("attn_only", None)
        suite = Suite(backend, source=source, platform=platform,
                      quick=bool(config.getoption("attn_quick", False)),
                      only=sorted(f.strip() for f in only.split(",")) if only else None,
                      distribution=distribution)
    config.stash[key] = suite
    return suite
