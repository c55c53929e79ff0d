"""The ``attn-backends`` command: list, explain, check, matrix, probe, bench, doctor."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from attn_backends.contract.capabilities import DTYPES
from attn_backends.contract.errors import AttnBackendsError, AttnBackendsWarning

from . import report as _report
from .call_flags import add_call_flags, call_arguments, ints, margin, positive, seq_lengths
from .matrix import MATRIX_BEGIN, MATRIX_END
from .text import table as _table


def _registry() -> Any:
    from attn_backends.choose.registry import registry

    return registry


def cmd_list(args: argparse.Namespace) -> int:
    import jax
    from attn_backends.choose.select import jax_range_reason
    from attn_backends.contract.environment import resolve

    registry = _registry()
    backends, origins, problems = registry.backends, registry.origins, registry.problems
    platform, _ = resolve(None)
    records = []
    for name in sorted(backends):
        backend, origin = backends[name], origins[name]
        caps = backend.capabilities
        records.append(
            {
                "backend": name,
                "distribution": origin.distribution,
                "version": backend.version,
                "api_version": backend.api_version,
                "priority": dict(backend.priority),
                "capabilities": caps.as_dict(),
                "certified": _report.certificate_summary(backend, platform),
                "probes": _report.probe_summary(backend),
                "refused": jax_range_reason(backend, jax.__version__),
            }
        )
    from attn_backends.probe.tuning import table_summary

    tuning = table_summary(None, platform, backends)
    if args.json:
        print(json.dumps({"backends": records, "problems": [str(p) for p in problems],
                          "tuning": tuning}, indent=2))
        return 0
    rows = []
    for rec in records:
        caps = rec["capabilities"]
        features = [f for f in ("gqa", "causal", "window", "segment_ids", "lengths", "mask",
                                "bias", "bias_grad", "softcap", "return_lse") if caps[f]]
        rows.append([
            rec["backend"], rec["distribution"], rec["version"],
            ",".join(caps["platforms"]), ",".join(caps["dtypes"]), caps["head_dims"],
            ",".join(features) or "-", rec["certified"], rec["probes"],
        ])
    if rows:
        header = ["backend", "distribution", "version", "platforms", "dtypes", "head dims",
                  "features", "certified", "probes"]
        print(_table(rows, header))
    else:
        print("no backends installed: pip install attn-backend-reference (or attn-backends[xla])")
    if problems:
        print("\nload problems:")
        for problem in problems:
            print(f"  - {problem}")
    refused = [f"{n}: {rec['refused']}" for n, rec in ((r["backend"], r) for r in records)
               if rec["refused"]]
    if refused:
        print("\nnever selected here:")
        for line in refused:
            print(f"  - {line}")
    if tuning is not None:
        print(f"\ntuning table {tuning['path']}: " + (tuning.get("problem") or (
            f"{tuning['counting']} entries count on {platform}, "
            f"{len(tuning['void'])} reasons void others, {tuning['other_environments']} "
            "measured elsewhere")))
        for reason in tuning.get("void", []):
            print(f"  - void: {reason}")
    return 0


def cmd_explain_paged(args: argparse.Namespace) -> int:
    if args.heads is None or args.head_dim is None or args.page_size is None:
        raise SystemExit("explain --paged: give --heads HQ,HKV, --head-dim D and --page-size N")
    if args.window is not None and args.window[1] is not None:
        raise SystemExit("explain --paged: --window takes LEFT, (paged attention is causal)")
    explanation = _registry().explain_paged(
        device=args.device, backend=args.backend,
        prefer=args.prefer.split(",") if args.prefer else None,
        num_q_heads=args.heads[0], num_kv_heads=args.heads[1], head_dim=args.head_dim,
        page_size=args.page_size, dtype=args.dtype, softcap=args.softcap,
        window=args.window, max_q_len=args.max_q_len, kv_dtype=args.kv_dtype)
    print(explanation.to_json() if args.json else explanation)
    return 0 if explanation.chosen else 1


def cmd_explain(args: argparse.Namespace) -> int:
    if args.paged:
        return cmd_explain_paged(args)
    if args.q is None or args.kv is None:
        raise SystemExit("explain: give --q and --kv (or --paged with its call)")
    q, k, v, kwargs = call_arguments(args)
    attention = _registry().get(
        device=args.device, backend=args.backend,
        prefer=args.prefer.split(",") if args.prefer else None, fallback="silent",
        layout=args.layout, tuning=args.tuning,
    )
    explanation = attention.explain(q, k, v, grad=args.grad, **kwargs)
    print(explanation.to_json() if args.json else explanation)
    return 0 if explanation.chosen else 1


def cmd_matrix(args: argparse.Namespace) -> int:
    from .matrix import cmd_matrix as matrix

    return matrix(args.certificates, markdown=args.markdown, into=args.into)


def cmd_tune(args: argparse.Namespace) -> int:
    from . import tune

    return tune.cmd_tune(args, _registry(), call_arguments, build_parser)


def _print_quarantined(records: list[dict[str, Any]]) -> None:
    if not records:
        print("no quarantined verdicts in the probe cache")
        return
    print(
        f"{len(records)} quarantined verdict(s) "
        "(attn-backends probe --clear NAME forgets them):"
    )
    for r in records:
        key = r.get("key", {})
        print(f"  {key.get('backend')} {key.get('backend_version')} on {key.get('platform')}"
              f" (jax {key.get('jax')}, options {key.get('options') or 'default'},"
              f" {r.get('date')})")
        print(f"    probe call: {r.get('probe_call')}  (first seen on {r.get('first_seen_on')})")
        for reason in r.get("reasons", []):
            print(f"    - {reason}")


def cmd_probe(args: argparse.Namespace) -> int:
    from attn_backends.contract.environment import resolve
    from attn_backends.probe import prober as _probe
    from attn_backends.probe import verdicts as _verdicts

    registry = _registry()
    if args.clear is not None:
        name = None if args.clear == "" else args.clear
        if name is not None:
            registry.backend(name)
        removed = _verdicts.clear(name)
        if isinstance(registry.probe, _probe.Prober):
            registry.probe.forget()
        print(
            f"removed {removed} probe verdict(s) of {name or 'every backend'} "
            f"from {_verdicts.folder()}"
        )
        return 0
    if args.quarantined:
        records = _probe.quarantined()
        if args.json:
            print(json.dumps(records, indent=2))
        else:
            _print_quarantined(records)
        return 1 if records else 0
    platform, present = resolve(args.device)
    if not present:
        print(f"attn-backends probe: JAX sees no {platform} here; probes run on the real device",
              file=sys.stderr)
        return 2
    prober = registry.probe if isinstance(registry.probe, _probe.Prober) else _probe.Prober()
    names = args.backends.split(",") if args.backends else sorted(registry.backends)
    results, quarantined = [], 0
    for name in names:
        backend = registry.backend(name)
        for call in _probe.probe_plan(backend):
            if backend.capabilities.unmet(call, platform):
                continue
            print(f"probing {name}: {call.describe()} ...", file=sys.stderr, flush=True)
            verdict = prober.verdict(backend, call, platform)
            quarantined += not verdict.passed
            results.append({
                "backend": name, "call": call.describe(), "passed": verdict.passed,
                "source": verdict.source, "seconds": round(verdict.seconds, 3),
                "reasons": list(verdict.reasons),
            })
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        rows = [[r["backend"], r["call"], "ok" if r["passed"] else "QUARANTINED", r["source"],
                 f"{r['seconds']:.2f}", "; ".join(r["reasons"]) or "-"] for r in results]
        print(_table(rows, ["backend", "call", "verdict", "source", "seconds", "reasons"]))
        print()
        _print_quarantined(_probe.quarantined())
    return 1 if quarantined else 0


def cmd_check(args: argparse.Namespace) -> int:
    try:
        from attn_backends_contracts import run_check
    except ImportError:
        print("attn-backends check: the conformance suite is not installed: "
              "pip install attn-backends-contracts", file=sys.stderr)
        return 2
    _registry().backend(args.backend)
    extra = (["--attn-quick"] if args.quick else []) + list(args.pytest_args)
    return run_check(args.backend, args.json, extra)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench as _bench

    return _bench.command(args, _registry())


def cmd_doctor(args: argparse.Namespace) -> int:
    report = _report.doctor(_registry())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if key == "backends":
            print("backends:")
            for rec in value:
                print("  " + "  ".join(f"{k}={v}" for k, v in rec.items()))
        elif key == "load_problems":
            print("load problems:" + ("" if value else " none"))
            for problem in value:
                print(f"  - {problem}")
        else:
            print(f"{key}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attn-backends", description="Inspect and choose JAX attention backends."
    )
    parser.add_argument(
        "--distributed", nargs="?", const="auto", metavar="ADDRESS,COUNT,PROCESS",
        help="join a multi-process JAX run first (jax.distributed.initialize): alone, as "
             "JAX finds its peers on Cloud TPU, SLURM, Kubernetes or MPI; or the coordinator "
             "address, the number of processes and this one's index, e.g. "
             "10.0.0.1:1234,4,0. Run the same command on every process: they agree on "
             "each choice (docs/MANY_CHIPS.md, \"Many hosts\")")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="installed backends, their manifests and load problems")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.set_defaults(func=cmd_list)

    p_exp = sub.add_parser("explain", help="every backend's verdict for a call")
    p_exp.add_argument("--device", default=None, help="cpu, gpu or tpu (default: JAX's default)")
    p_exp.add_argument("--q", type=ints(4), metavar="B,Tq,Hq,D",
                       help="q's shape (B,Hq,Tq,D with --layout BHTD); not with --paged")
    p_exp.add_argument("--kv", type=ints(4), metavar="B,Tk,Hkv,D",
                       help="k's shape (B,Hkv,Tk,D with --layout BHTD); not with --paged")
    p_exp.add_argument("--paged", action="store_true",
                       help="a paged KV-cache call: --heads, --head-dim, --page-size "
                            "[--max-q-len], with --dtype, --softcap, --window LEFT,")
    p_exp.add_argument("--heads", type=ints(2), default=None, metavar="HQ,HKV",
                       help="with --paged: query and kv heads")
    p_exp.add_argument("--head-dim", type=positive, default=None, help="with --paged: D")
    p_exp.add_argument("--page-size", type=positive, default=None,
                       help="with --paged: positions per page")
    p_exp.add_argument("--max-q-len", type=positive, default=None,
                       help="with --paged: most query rows per sequence (1: decode)")
    add_call_flags(p_exp)
    p_exp.add_argument("--tuning", default=None, metavar="TABLE",
                       help="a tuning table (default: ATTN_BACKENDS_TUNING or the cache's)")
    p_exp.add_argument("--grad", action="store_true",
                       help="the choice when the call is differentiated")
    p_exp.add_argument("--backend", default=None, help="judge only this backend")
    p_exp.add_argument("--prefer", default=None, help="comma-separated names to try first")
    p_exp.add_argument("--json", action="store_true")
    p_exp.set_defaults(func=cmd_explain)

    p_probe = sub.add_parser(
        "probe", help="probe installed backends on this device; list or clear quarantines")
    p_probe.add_argument("--device", default=None, help="cpu, gpu or tpu (default: JAX's default)")
    p_probe.add_argument("--backends", default=None, help="comma-separated names (default: all)")
    p_probe.add_argument("--quarantined", action="store_true",
                         help="only list the quarantined verdicts in the cache, with their numbers")
    p_probe.add_argument("--clear", nargs="?", const="", default=None, metavar="NAME",
                         help="forget the cached verdicts of NAME (of every backend without NAME)")
    p_probe.add_argument("--json", action="store_true")
    p_probe.set_defaults(func=cmd_probe)

    p_check = sub.add_parser("check", help="run the conformance suite against a backend")
    p_check.add_argument("backend", help="installed backend name")
    p_check.add_argument("--json", default=None, metavar="FILE", help="write the certificate here")
    p_check.add_argument("--quick", action="store_true", help="reduced case table")
    p_check.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    p_check.set_defaults(func=cmd_check)

    p_matrix = sub.add_parser(
        "matrix", help="which backend passed which contract family, from certificates")
    p_matrix.add_argument(
        "certificates", nargs="*", metavar="CERT",
        help="certificate files (attn-backends check NAME --json FILE) or folders of them "
             "(default: .certificates, where make test writes them)")
    p_matrix.add_argument("--markdown", action="store_true",
                          help="Markdown tables (for a README) instead of plain text")
    p_matrix.add_argument(
        "--into", metavar="FILE", default=None,
        help="write the Markdown tables into FILE, between its lines "
             f"'{MATRIX_BEGIN}' and '{MATRIX_END}' (a README's matrix), instead of printing")
    p_matrix.set_defaults(func=cmd_matrix)

    p_tune = sub.add_parser(
        "tune", help="time every backend that may serve a call here; write a tuning table")
    p_tune.add_argument("--device", default=None, help="cpu, gpu or tpu (default: JAX's default)")
    p_tune.add_argument("--q", type=ints(4), metavar="B,Tq,Hq,D",
                        help="q's shape (B,Hq,Tq,D with --layout BHTD)")
    p_tune.add_argument("--kv", type=ints(4), metavar="B,Tk,Hkv,D",
                        help="k's shape (B,Hkv,Tk,D with --layout BHTD)")
    add_call_flags(p_tune)
    passes = p_tune.add_mutually_exclusive_group()
    passes.add_argument("--grad", action="store_true", help="time forward+backward only")
    passes.add_argument("--both", action="store_true",
                        help="time forward, and forward+backward, as two entries")
    p_tune.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                        help="more calls: one per line, in these flags (--q ... --kv ... "
                        "[--causal] [--grad]); # starts a comment")
    p_tune.add_argument("--out", default=None, metavar="TABLE",
                        help="the table to write or merge into (default: the cache "
                        "folder's, which selection reads when nothing else is named)")
    p_tune.add_argument("--rounds", type=positive, default=7)
    p_tune.add_argument("--runs", type=positive, default=3, help="runs per round")
    p_tune.add_argument("--warmup", type=positive, default=2)
    p_tune.add_argument("--margin", type=margin, default=0.05,
                        help="how much faster a backend must be than the priority choice")
    p_tune.add_argument("--json", action="store_true", help="print the entries as JSON")
    p_tune.set_defaults(func=cmd_tune)

    p_bench = sub.add_parser("bench", help="time installed backends on this device")
    p_bench.add_argument("--device", default=None, help="cpu, gpu or tpu (default: JAX's default)")
    p_bench.add_argument("--backends", default=None, help="comma-separated names (default: all)")
    p_bench.add_argument("--seq", type=seq_lengths, default="512,1024,2048",
                         help="sequence lengths, comma-separated")
    p_bench.add_argument("--heads", type=positive, default=8)
    p_bench.add_argument("--head-dim", type=positive, default=64)
    p_bench.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p_bench.add_argument("--no-causal", action="store_true")
    p_bench.add_argument("--reps", type=positive, default=5)
    p_bench.add_argument("--decode", action="store_true",
                         help="time decode steps (one query, GQA 4, kv_lengths) against caches "
                         "of the --seq lengths, with each backend's share of the jnp.sum "
                         "bandwidth; --no-causal and --plot do not apply")
    p_bench.add_argument("--json", action="store_true")
    p_bench.add_argument(
        "--plot", default=None, metavar="FILE.png", help="needs attn-backends[plot]"
    )
    p_bench.set_defaults(func=cmd_bench)

    p_doc = sub.add_parser("doctor", help="environment report to paste into a bug report")
    p_doc.add_argument("--json", action="store_true")
    p_doc.set_defaults(func=cmd_doctor)
    return parser


def _join(spec: str) -> None:
    """``jax.distributed.initialize`` for ``--distributed`` ("auto", or ADDRESS,COUNT,PROCESS)."""
    import jax

    if spec == "auto":
        jax.distributed.initialize()
        return
    parts = spec.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts[1:]):
        raise ValueError(f"--distributed: expected ADDRESS,COUNT,PROCESS (e.g. "
                         f"10.0.0.1:1234,4,0) or nothing, got {spec!r}")
    jax.distributed.initialize(coordinator_address=parts[0], num_processes=int(parts[1]),
                               process_id=int(parts[2]))


def _one_line_warnings(other: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` printing the library's own warnings as one
    line on stderr, ``attn-backends: PluginWarning: ...`` (a person at the
    command reads what was refused and why, not the line of the console script
    that happened to run), and handing every other warning to ``other``, the
    one in place when the command started."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, AttnBackendsWarning):
            print(f"attn-backends: {category.__name__}: {message}", file=file or sys.stderr)
            return
        other(message, category, filename, lineno, file, line)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warnings(warnings.showwarning)
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Split at "--" here: argparse cannot take `check NAME --quick -- -k x`
    # (options between the name and the extra positionals).
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if extra:
        if args.command != "check":
            parser.error(f"arguments after -- are extra pytest arguments, only for check: {extra}")
        args.pytest_args = [*args.pytest_args, *extra]
    try:
        if args.distributed is not None:
            _join(args.distributed)
        return int(args.func(args))
    except (AttnBackendsError, ValueError) as exc:
        print(f"attn-backends {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
