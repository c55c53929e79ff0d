"""`attn-backends tune`: time every backend that may serve a call, write a tuning table.

For each call (forward, or forward and backward) the candidates are the
backends that pass the manifest, ``check`` and the probe here. Each is compiled
alone (the compile time is recorded, never ranked), run ``warmup`` times, then
the candidates are timed interleaved in ``rounds`` rounds (the order rotates
each round, so no candidate always runs after the same one), each round the
mean of ``runs`` runs; the median and spread of the rounds are kept and
:func:`~attn_backends.probe.tuning.decide` picks the winner against the
priority choice. One process, one device: selection never times by itself;
it reads what this wrote (docs/DESIGN.md, "Measured selection").
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attn_backends.contract.call import AttentionCall
from attn_backends.contract.errors import AttnBackendsWarning, warn
from attn_backends.probe.tuning import (
    DEFAULT_MARGIN,
    Identity,
    TableEntry,
    Timing,
    TuningTable,
    decide,
    now_stamp,
    shape_class,
)

#: ``timer(backend, run) -> seconds``: how long one ``run()`` took, its result
#: ready. Tests pass a scripted one; :func:`wall_clock` is the real one.
Timer = Callable[[str, Callable[[], Any]], float]


def wall_clock(backend: str, run: Callable[[], Any]) -> float:
    """Seconds one ``run()`` takes until its result is ready (``perf_counter``)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


class TuneWarning(AttnBackendsWarning):
    """A candidate failed to compile or run while being tuned and is left out."""


@dataclass(frozen=True)
class Signature:
    """One call to tune: its static description and whether the backward pass is timed."""

    call: AttentionCall
    grad: bool = False


@dataclass
class _Candidate:
    name: str
    run: Callable[[], Any]
    compile_s: float


def candidates(registry: Any, call: AttentionCall, platform: str) -> tuple[str | None, list[str]]:
    """The priority choice for ``call`` on ``platform`` and every backend that passes
    manifest, ``check`` and probe (each probed, not only those above the choice)."""
    attention = registry.get(device=platform, fallback="silent")
    explanation = attention.explain_call(call)
    names = []
    for verdict in explanation.verdicts:
        if not verdict.accepted:
            continue
        if verdict.probed is None and explanation.present and verdict.backend != explanation.chosen:
            pinned = registry.get(device=platform, backend=verdict.backend, fallback="silent")
            if pinned.explain_call(call).chosen != verdict.backend:
                continue
        names.append(verdict.backend)
    return explanation.chosen, names


def _program(registry: Any, name: str, platform: str, signature: Signature,
             options: Any) -> _Candidate:
    """``name``'s compiled program for the signature, with random inputs bound."""
    import jax
    import jax.numpy as jnp
    from attn_backends.probe.run import inputs

    call = signature.call
    arrays = inputs(call)
    q, k, v = (jnp.asarray(arrays[x]) for x in "qkv")
    ops = arrays["operands"]
    attention = registry.get(device=platform, backend=name, fallback="error",
                             backend_options=None if options is None else {name: options})

    def forward(q: Any, k: Any, v: Any, ops: dict[str, Any]) -> Any:
        return attention(q, k, v, scale=call.scale, causal=call.causal, window=call.window,
                         softcap=call.softcap, return_lse=call.return_lse,
                         dropout_rate=call.dropout_rate, **ops)

    def loss(q: Any, k: Any, v: Any, ops: dict[str, Any]) -> Any:
        out = forward(q, k, v, ops)
        out = out[0] if call.return_lse else out
        return out.astype(jnp.float32).sum()

    fn = jax.grad(loss, argnums=(0, 1, 2)) if signature.grad else forward
    ops = jax.tree_util.tree_map(jnp.asarray, ops)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(q, k, v, ops).compile()
    return _Candidate(name, lambda: compiled(q, k, v, ops), time.perf_counter() - start)


#: Timed rounds per candidate unless told (``--rounds``).
ROUNDS = 5
#: ``advance(backend, n)``: n more of a tune's steps are done (one candidate
#: compiled and warmed up, or timed for one round), the last by ``backend``.
Advance = Callable[[str, int], None]


def tune_one(registry: Any, signature: Signature, platform: str, *, timer: Timer = wall_clock,
             warmup: int = 2, rounds: int = ROUNDS, runs: int = 3,
             margin: float = DEFAULT_MARGIN, backend_options: dict[str, Any] | None = None,
             identity: Identity, advance: Advance = lambda backend, n: None,
             ) -> TableEntry | None:
    """The entry for one signature (None: no backend serves it here); ``advance``
    hears of each step, ``1 + rounds`` per candidate."""
    default, names = candidates(registry, signature.call, platform)
    if default is None:
        warn(f"tune: no backend serves {signature.call.describe()} on {platform}; "
             "no entry written", TuneWarning)
        return None
    failed: dict[str, str] = {}
    ready: list[_Candidate] = []
    for name in names:
        try:
            candidate = _program(registry, name, platform, signature,
                                 (backend_options or {}).get(name))
            for _ in range(warmup):
                timer(name, candidate.run)
        except Exception as exc:  # noqa: BLE001 - recorded and reported, never a winner
            failed[name] = f"{type(exc).__name__}: {exc}"
            warn(f"tune: backend {name!r} failed on {signature.call.describe()}: "
                 f"{failed[name]}; left out of this entry", TuneWarning)
            advance(name, 1 + rounds)
            continue
        ready.append(candidate)
        advance(name, 1)
    times: dict[str, list[float]] = {c.name: [] for c in ready}
    for r in range(rounds):
        shift = r % max(len(ready), 1)
        for candidate in ready[shift:] + ready[:shift]:
            times[candidate.name].append(
                sum(timer(candidate.name, candidate.run) for _ in range(runs)) / runs)
            advance(candidate.name, 1)
    timings = {c.name: Timing.of(times[c.name], c.compile_s) for c in ready}
    if default in timings:
        winner, reason = decide(timings, default, margin)
    else:
        winner, reason = default, f"priority choice: it failed to run here ({failed[default]})"
    measured = {name: {**(identity(name) or {}), **vars(t)} for name, t in timings.items()}
    measured.update({name: {**(identity(name) or {}), "failed": why}
                     for name, why in failed.items()})
    return TableEntry(shape_class(signature.call, signature.grad), default=default, winner=winner,
                 reason=reason, margin=margin, candidates=measured, measured_at=now_stamp())


def tune(registry: Any, signatures: Sequence[Signature], platform: str, *,
         environment: dict[str, Any], identity: Identity,
         **timing: Any) -> TuningTable:
    """A table of one entry per signature served here (``timing``: :func:`tune_one`'s),
    with a progress bar on stderr while it measures (none when stderr is not a
    terminal): the call being tuned, the backend last timed, the steps done."""
    from tqdm import tqdm

    steps = sum(len(candidates(registry, s.call, platform)[1]) for s in signatures)
    table = TuningTable()
    with tqdm(total=steps * (1 + timing.get("rounds", ROUNDS)), desc="tune", unit="step",
              disable=None, file=sys.stderr) as bar:
        def advance(backend: str, n: int) -> None:
            bar.set_postfix_str(backend, refresh=False)
            bar.update(n)

        for number, signature in enumerate(signatures, 1):
            bar.set_description(f"tune {number}/{len(signatures)} "
                                f"{signature.call.describe()}{' fwd+bwd' * signature.grad}")
            entry = tune_one(registry, signature, platform, identity=identity,
                             advance=advance, **timing)
            if entry is not None:
                table.add(environment, entry)
    return table


def signatures_from_args(args: Any, registry: Any, call_arguments: Callable[[Any], Any],
                         ) -> list[Signature]:
    """The signatures one command line (or one ``--from`` line) names. A ValueError
    names flags that ask for what cannot be timed, before any call is built: a
    quantized K and V's attention is forward only, so ``--kv-dtype`` with
    ``--grad`` or ``--both`` has no backward to time."""
    if args.kv_dtype is not None and (args.grad or args.both):
        raise ValueError(f"--kv-dtype {args.kv_dtype}: attention over a quantized K and V is "
                         "forward only; tune it without --grad or --both")
    if args.q is None or args.kv is None:
        return []
    q, k, v, kwargs = call_arguments(args)
    call = registry.get(device=args.device, fallback="silent",
                        layout=args.layout).explain(q, k, v, **kwargs).call
    passes = (False, True) if args.both else (bool(args.grad),)
    return [Signature(call, grad) for grad in passes]


def cmd_tune(args: Any, registry: Any, call_arguments: Callable[[Any], Any],
             build_parser: Callable[[], Any]) -> int:
    """`attn-backends tune`: measure, merge into ``--out``, print what was chosen."""
    import json
    import shlex

    from attn_backends.contract.environment import TABLE_NAME, cache_dir, resolve
    from attn_backends.probe.tuning import environment, identity

    platform, present = resolve(args.device)
    if not present:
        print(f"attn-backends tune: JAX sees no {platform} here; tune on the machine the "
              "table is for", file=sys.stderr)
        return 2
    try:
        signatures = signatures_from_args(args, registry, call_arguments)
    except ValueError as error:
        print(f"attn-backends tune: {error}", file=sys.stderr)
        return 2
    if args.from_file:
        parser = build_parser()
        with open(args.from_file) as lines:
            for number, line in enumerate(lines, 1):
                words = shlex.split(line, comments=True)
                if not words:
                    continue
                try:
                    one = parser.parse_args(["tune", "--device", platform, *words])
                except SystemExit:
                    print(f"attn-backends tune: {args.from_file}:{number}: not a call in "
                          f"tune's flags: {line.strip()!r}", file=sys.stderr)
                    return 2
                try:
                    signatures += signatures_from_args(one, registry, call_arguments)
                except ValueError as error:
                    print(f"attn-backends tune: {args.from_file}:{number}: {error}",
                          file=sys.stderr)
                    return 2
    if not signatures:
        print("attn-backends tune: no call to tune: give --q and --kv (and the call's "
              "flags), or --from FILE", file=sys.stderr)
        return 2
    table = tune(registry, signatures, platform, environment=environment(platform),
                 identity=identity(registry.backends), warmup=args.warmup,
                 rounds=args.rounds, runs=args.runs, margin=args.margin)
    out = args.out or cache_dir() / TABLE_NAME
    table.save(out)
    entries = [entry for section in table.sections for entry in section.entries.values()]
    if args.json:
        print(json.dumps([vars(e) for e in entries], indent=1))
    for entry in entries:
        cls = entry.shape_class
        what = (f"q[{cls['batch']},{cls['q_len']},{cls['q_heads']},{cls['head_dim']}] "
                f"kv[{cls['kv_len']},{cls['kv_heads']}] {cls['dtype']}"
                f"{' kv=' + cls['kv_dtype'] if cls.get('kv_dtype') else ''}"
                f"{' causal' if cls['causal'] else ''} {'fwd+bwd' if cls['grad'] else 'fwd'}")
        print(f"{what}: {entry.winner} ({entry.reason}; {entry.summary()})", file=sys.stderr)
    print(f"tuning table written to {out}", file=sys.stderr)
    return 0


def signatures_of(fn: Callable[..., Any], *args: Any, passes: Sequence[bool] = (False, True),
                  **kwargs: Any) -> list[Signature]:
    """Every attention call ``fn(*args, **kwargs)`` makes, found by tracing it
    (``jax.jit(fn).trace``; nothing runs), as one signature per pass in ``passes``
    (False: forward; True: forward and backward; a quantized K and V's call
    forward only)."""
    import jax
    from attn_backends.choose.select import recording_calls

    with recording_calls() as calls:
        jax.jit(fn).trace(*args, **kwargs)
    # A quantized K and V is forward only: no backward to time.
    return [Signature(call, grad) for call in calls for grad in passes
            if not (grad and call.kv_dtype is not None)]
