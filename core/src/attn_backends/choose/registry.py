"""The registry: discovery on first use, and ``get()`` returning an Attention."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract.backend import Backend, CallableProbe, Features, implements_a_seam
from ..contract.errors import AttnBackendsWarning, UnknownBackendError, warn
from .discovery import Discovered, LoadProblem, Origin, Settings, discover
from .select import LOCAL_WORK, Explanation, Probe

if TYPE_CHECKING:
    from .attention import Attention
    from .paged import PagedAttention

FALLBACK_MODES = ("warn", "error", "silent")


def _jax_version() -> str:
    import jax

    return jax.__version__


class Registry:
    """Installed backends, loaded lazily, and the entry point for selection.

    ``plugins`` are in-process plugin objects (modules or instances holding
    ``@hookimpl`` functions): backends (``attn_backends_register``) and
    implementations of core's seams (contract/backend.py), registered besides the
    entry points. Settings left as None come from the ``ATTN_BACKENDS_*``
    environment variables when discovery runs. ``probe`` is "auto" (core's
    probe: each backend compared with the float64 oracle once per verdict key,
    cached on disk; docs/DESIGN.md, "Probes"), None (no probes) or a callable
    ``probe(backend, call, platform, options) -> reasons`` (its ``paged``
    attribute, when it has one, probes paged calls). ``block`` names core
    plugins left out ("probe", "tuning", "hosts", "parallel"). Sharded inputs
    and ``get(mesh=, spec=, sequence_axis=)`` are served by the parallel
    layer; in a multi-process run every process agrees on each choice
    (docs/MANY_CHIPS.md, "Many hosts") but local work, which each chooses alone
    (``attn_backends.local_work()``).
    """

    def __init__(
        self,
        *,
        plugins: Sequence[object] = (),
        autoload: bool | None = None,
        strict: bool | None = None,
        only: Sequence[str] | None = None,
        disable: Sequence[str] | None = None,
        probe: Probe | None | str = "auto",
        block: Sequence[str] = (),
    ):
        self._plugins = list(plugins)
        self._overrides = {
            "autoload": autoload,
            "strict": strict,
            "only": None if only is None else frozenset(only),
            "disable": None if disable is None else frozenset(disable),
        }
        #: The seams' plugin manager: probes, tuning tables, the parallel layer,
        #: agreement across processes (contract/backend.py).
        self.features = Features(self._plugins, block)
        if isinstance(probe, str):
            if probe != "auto":
                raise ValueError(
                    f"probe: expected 'auto', None or a callable "
                    f"probe(backend, call, platform, options), got {probe!r}"
                )
        else:
            self.probe = probe
        self._discovered: Discovered | None = None
        # Re-entrant: a plugin that reads the registry while it is imported
        # must not deadlock discovery.
        self._lock = threading.RLock()
        #: Bumped on every reload, so Attention objects drop older selections.
        self.generation = 0

    @property
    def probe(self) -> Any:
        """The probe selection consults: core's Prober (built on first use), the
        callable given, or None."""
        plugin = self.features.plugin("probe")
        return plugin.probe if isinstance(plugin, CallableProbe) else plugin

    @probe.setter
    def probe(self, probe: Any) -> None:
        if probe is not None and not implements_a_seam(probe):
            probe = CallableProbe.of(probe)
        self.features.replace("probe", probe)

    def _load(self) -> Discovered:
        with self._lock:
            if self._discovered is None:
                settings = Settings.from_env(**self._overrides)
                self._discovered = discover(settings, _jax_version(), self._plugins)
            return self._discovered

    def reload(self) -> None:
        """Forget discovery results; the next use discovers again."""
        with self._lock:
            self._discovered = None
            self.generation += 1

    def register(self, plugin: object) -> None:
        """Add an in-process plugin object (backends, seams or both) and rediscover."""
        self._plugins.append(plugin)
        if implements_a_seam(plugin):
            self.features.register(plugin)
        self.reload()

    @property
    def backends(self) -> dict[str, Backend]:
        """Registered backends by name."""
        return dict(self._load().backends)

    @property
    def origins(self) -> dict[str, Origin]:
        """Where each registered backend came from."""
        return dict(self._load().origins)

    @property
    def problems(self) -> list[LoadProblem]:
        """Plugins and backends skipped at discovery, with the reason."""
        return list(self._load().problems)

    def backend(self, name: str) -> Backend:
        """The backend called ``name``; UnknownBackendError lists the installed ones."""
        backends = self.backends
        if name not in backends:
            installed = ", ".join(sorted(backends)) or "none"
            raise UnknownBackendError(
                f"backend={name!r}: no such backend is registered (installed: {installed}). "
                "Install its distribution, or check ATTN_BACKENDS_ONLY / ATTN_BACKENDS_DISABLE."
            )
        return backends[name]

    def get(
        self,
        device: Any = None,
        backend: str | None = None,
        prefer: str | Sequence[str] | None = None,
        fallback: str = "warn",
        backend_options: Mapping[str, Any] | None = None,
        *,
        layout: str = "BTNH",
        mesh: Any = None,
        spec: Any = None,
        sequence_axis: str | None = None,
        ring_block: int | None = None,
        tuning: str | os.PathLike[str] | None = None,
    ) -> Attention:
        """An :class:`Attention` callable for ``device`` (None = JAX's default).

        ``device``: None, "cpu", "gpu" or "tpu" (or "cuda"), a ``jax.Device``, or
        a list of these for a program exported for several platforms
        (``jax.export(..., platforms=[...])``): each gets its own selection, and
        each backend is lowered only for the platform it was selected for
        (lowering for a platform not asked for raises PlatformUnavailableError).

        ``backend="x"`` is strict (no fallback). ``prefer`` lists names to try
        first. ``fallback`` is "warn", "error" or "silent". ``backend_options``
        maps a backend name to its config object (e.g. block sizes).

        ``layout`` is the axis order of q, k, v and the output: ``"BTNH"``
        (``[B, T, H, D]``, the contract's and ``jax.nn.dot_product_attention``'s)
        or ``"BHTD"`` (``[B, H, T, D]``, PyTorch's), which the Attention
        transposes to and from BTNH; lse, mask, bias, ids, lengths and scales
        keep their shapes. Shapes alone cannot tell the two apart when head counts divide
        (docs/DESIGN.md, section 2): code holding BHTD arrays says so here.

        Sharding (docs/MANY_CHIPS.md): ``mesh`` (a ``jax.sharding.Mesh`` or
        ``AbstractMesh``) and ``spec`` (a ``PartitionSpec`` over the dims of
        q, k, v in ``layout``) say how inputs are laid out when their own
        sharding does not (e.g. under ``jit`` with Auto axes); ``sequence_axis`` names the mesh
        axis the sequence is split over, which runs ring attention, whose
        backend calls take sub-chunks of at most ``ring_block`` tokens (None:
        1024).

        ``tuning`` is a tuning table (``attn-backends tune --out PATH``); None:
        ``ATTN_BACKENDS_TUNING``, else the cache folder's table when ``tune``
        wrote one there, else none. Its measured winner for a call's shape class
        is tried first after ``prefer``; ``backend=`` ignores it. Selection reads
        the table and never times (docs/DESIGN.md, "Measured selection").
        """
        from ..contract.environment import resolve_all
        from .attention import Attention

        if fallback not in FALLBACK_MODES:
            raise ValueError(f"fallback: expected one of {FALLBACK_MODES}, got {fallback!r}")
        if backend is not None:
            self.backend(backend)
        if tuning is not None and not Path(tuning).expanduser().is_file():
            raise ValueError(f"tuning={str(tuning)!r}: no such file; make a table with "
                             f"`attn-backends tune --out {tuning}` (docs/DESIGN.md, "
                             "\"Measured selection\")")
        if isinstance(prefer, str):
            prefer = (prefer,)
        self._not_installed("prefer", prefer or ())
        self._not_installed("backend_options", backend_options or {})
        return Attention(
            self,
            platforms=resolve_all(device),
            backend=backend,
            prefer=tuple(prefer or ()),
            fallback=fallback,
            backend_options=dict(backend_options or {}),
            sharding=self._sharding_request(mesh, _btnh_spec(spec, layout), sequence_axis,
                                            ring_block),
            layout=layout,
            tuning=None if tuning is None else Path(tuning).expanduser(),
        )

    def get_paged(
        self,
        device: Any = None,
        backend: str | None = None,
        prefer: str | Sequence[str] | None = None,
        fallback: str = "warn",
        backend_options: Mapping[str, Any] | None = None,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: Any,
        scale: float | None = None,
        softcap: float | None = None,
        window: tuple[int, None] | None = None,
        max_q_len: int | None = None,
        kv_dtype: Any = None,
        cache_dtype: Any = None,
    ) -> PagedAttention:
        """A :class:`~attn_backends.choose.paged.PagedAttention` for ``device``:
        selection runs here, once, because the cache is made in the chosen
        backend's layout (docs/DESIGN.md, "Paged attention").

        ``device``, ``backend``, ``prefer``, ``fallback`` and ``backend_options``
        as in :meth:`get`, for one platform. The rest describe the call:
        q ``[T, num_q_heads, head_dim]``, K and V of ``num_kv_heads`` heads in
        pages of ``page_size`` positions, ``dtype``; ``scale`` (default
        ``head_dim ** -0.5``), ``softcap``, ``window=(left, None)``; ``max_q_len``
        the most query rows one sequence has in a batch (None: any);
        ``kv_dtype``: "int8", "float8_e4m3fn" or "float8_e5m2" for a cache
        stored quantized, values and a float32 scale per position and kv head
        (None: K and V in ``dtype``; docs/DESIGN.md, "Quantized caches").

        In a multi-process run the processes agree on the backend, unless it is
        got inside ``attn_backends.local_work()``: then this process chooses it
        alone, and it refuses arrays that span processes (docs/MANY_CHIPS.md,
        "Local work").
        """
        from ..contract.paged_bind import bind_paged
        from .paged import PagedAttention, choose_paged

        call = bind_paged(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, page_size=page_size, dtype=dtype, scale=scale,
                          softcap=softcap, window=window, max_q_len=max_q_len,
                          kv_dtype=kv_dtype, cache_dtype=cache_dtype)
        explanation, present = self._explain_paged(call, device, backend, prefer, fallback,
                                                   backend_options)
        chosen = choose_paged(explanation, pinned=backend, fallback=fallback)
        return PagedAttention(call, self.backend(chosen), explanation, present=present,
                              options=(backend_options or {}).get(chosen),
                              local=explanation.agreement == LOCAL_WORK)

    def explain_paged(self, device: Any = None, backend: str | None = None,
                      prefer: str | Sequence[str] | None = None, **call: Any) -> Explanation:
        """Every backend's verdict for a paged call (``call``: :meth:`get_paged`'s
        keyword arguments) on ``device``; chooses nothing, warns nothing."""
        from ..contract.paged_bind import bind_paged

        return self._explain_paged(bind_paged(**call), device, backend, prefer, "silent",
                                   None)[0]

    def _explain_paged(self, call: Any, device: Any, backend: str | None, prefer: Any,
                       fallback: str, backend_options: Mapping[str, Any] | None,
                       ) -> tuple[Explanation, bool]:
        from ..contract.environment import marked, process_count, resolve_all
        from .paged import select_paged

        if fallback not in FALLBACK_MODES:
            raise ValueError(f"fallback: expected one of {FALLBACK_MODES}, got {fallback!r}")
        platforms = resolve_all(device)
        if len(platforms) != 1:
            raise ValueError(f"device: paged attention serves one platform, got "
                             f"{[p for p, _ in platforms]}")
        platform, present = platforms[0]
        candidates = self.backends if backend is None else {backend: self.backend(backend)}
        prefer = (prefer,) if isinstance(prefer, str) else tuple(prefer or ())
        self._not_installed("prefer", prefer)
        self._not_installed("backend_options", backend_options or {})
        # No arrays to judge yet: local work only where marked (contract/environment.py).
        local = process_count() > 1 and marked()
        agree = self.features.hook("attn_backends_agree") if process_count() > 1 and not local \
            else None

        def judge(probe_also: frozenset[str] = frozenset()) -> Explanation:
            return select_paged(
                call, platform, list(candidates.values()), jax_version=_jax_version(),
                present=present, prefer=prefer,
                distributions={n: o.distribution for n, o in self.origins.items()},
                probe=self.features.hook("attn_backends_probe_paged"), options=backend_options,
                probe_also=probe_also)

        explanation = judge()
        if agree is not None:
            # Every process makes its cache in the layout of the one backend
            # they all serve (docs/MANY_CHIPS.md, "Many hosts").
            question = ("paged", call, platform, backend, prefer,
                        tuple(sorted(backend_options or {})))
            explanation = agree(explanation, question, judge)
        if local:
            explanation = dataclasses.replace(explanation, agreement=LOCAL_WORK)
        return explanation, present

    def _not_installed(self, what: str, names: Any) -> None:
        """Warn of the ``names`` (prefer=, backend_options=) no installed backend has.
        Not an error: model code may name a backend installed only on some
        machines. But a typo must not pass unnoticed."""
        if not names:
            return
        backends = self.backends
        unknown = sorted(set(names) - set(backends))
        if unknown:
            lead = (f"prefer={list(names)}: {', '.join(map(repr, unknown))}" if what == "prefer"
                    else f"{what}: {', '.join(map(repr, unknown))}")
            warn(f"{lead} not installed (installed: {', '.join(sorted(backends)) or 'none'}); "
                 "ignored", AttnBackendsWarning)

    def _sharding_request(self, mesh: Any, spec: Any, sequence_axis: str | None,
                          ring_block: int | None) -> Any:
        """The parallel layer's request for these arguments (None when none is given)."""
        if mesh is None and spec is None and sequence_axis is None and ring_block is None:
            return None
        request = self.features.hook("attn_backends_sharding_request")
        if request is None:
            raise ValueError(
                "mesh=, spec=, sequence_axis=, ring_block=: this registry's parallel "
                "layer is blocked (Registry(block=['parallel']))"
            )
        return request(mesh, spec, sequence_axis, ring_block)

    def explain(self, q: Any, k: Any, v: Any, *, device: Any = None, layout: str = "BTNH",
                tuning: str | os.PathLike[str] | None = None, **kwargs: Any) -> Explanation:
        """Every backend's verdict for this call on ``device`` (arrays or ShapeDtypeStructs
        in ``layout``), and what the tuning table (:meth:`get`'s ``tuning``) says of it."""
        return self.get(device=device, fallback="silent", layout=layout,
                        tuning=tuning).explain(q, k, v, **kwargs)


def _btnh_spec(spec: Any, layout: str) -> Any:
    """A ``PartitionSpec`` over ``layout``'s dims as one over the contract's BTNH dims."""
    if spec is None or layout == "BTNH":
        return spec
    b, h, t, d = (*spec, None, None, None, None)[:4]
    return type(spec)(b, t, h, d)


#: The process-wide registry: ``attn_backends.registry.get(device="tpu")``.
registry = Registry()
