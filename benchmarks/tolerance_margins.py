"""How far below the float32 tolerances the in-repo backends stay, per case family.

For each backend named, runs every float32 case of the full conformance table
(tiles twins included) through the suite's own runner and prints, per family
and output, the worst per-element error as a fraction of the tolerance
(``attn_backends.tolerances.normalised_error``) over all the backends, and
its inverse: how many times the tolerance exceeds the worst error reached.
The tolerance table promises that inverse is at most 100 where the worst
error is above the floor (docs/FAULTS_COVERAGE.md).

    python benchmarks/tolerance_margins.py xla_native reference example_dense
    ATTN_BACKENDS_PALLAS_INTERPRET=1 python benchmarks/tolerance_margins.py flash_pallas
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from attn_backends_contracts._session import Suite, local_platform
from attn_backends_contracts.tolerances import GRADIENT_FINITE_ONLY_INPUTS


def margins(names: list[str], dtype: str, limit: int | None = None,
            families: set[str] | None = None) -> dict[str, dict[str, tuple[float, str]]]:
    """``{family: {output: (worst normalised error, backend)}}`` over ``names``.

    ``limit``: run only the first cases of each family (and of its tiles
    twins). A subset can only under-state the worst error, so the ratios it
    prints are upper bounds of the full table's. ``families``: only these.
    """
    import attn_backends

    worst: dict[str, dict[str, tuple[float, str]]] = defaultdict(dict)
    for name in names:
        backend = attn_backends.registry.backend(name)
        suite = Suite(backend, source="installed", platform=local_platform(), quick=False)
        taken: dict[tuple[str, bool], int] = defaultdict(int)
        for case in suite.cases:
            if case.dtype != dtype or (families and case.family not in families):
                continue
            if suite.declined(case):
                continue
            taken[case.family, case.tiles] += 1
            if limit is not None and taken[case.family, case.tiles] > limit:
                continue
            outcome = suite.outcome(case)
            for output, err in outcome.errors.items():
                if output.startswith("d") and case.inputs in GRADIENT_FINITE_ONLY_INPUTS:
                    continue
                if err > worst[case.family].get(output, (-1.0, ""))[0]:
                    worst[case.family][output] = (err, name)
            print(f"{name} {case.id}: " + " ".join(
                f"{k}={v:.3g}" for k, v in outcome.errors.items()), file=sys.stderr)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backends", nargs="+")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N cases of each family (and of its tiles twins)")
    parser.add_argument("--family", action="append", help="only this case family (repeatable)")
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args()
    worst = margins(args.backends, args.dtype, args.limit, set(args.family or ()))
    outputs = ("out", "lse", "dq", "dk", "dv", "dbias")
    print(f"worst error / tolerance ({args.dtype}, {local_platform()}, {args.backends}); "
          "in brackets: tolerance / worst error")
    print(f"{'family':13}" + "".join(f"{o:>18}" for o in outputs))
    for fam in sorted(worst):
        cells = []
        for o in outputs:
            if o in worst[fam]:
                err, _ = worst[fam][o]
                cells.append(f"{err:9.3g} [{1 / err if err else float('inf'):6.0f}]")
            else:
                cells.append("-")
        print(f"{fam:13}" + "".join(f"{c:>18}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(worst, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
