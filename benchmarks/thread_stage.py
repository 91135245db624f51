"""Thread stage benchmark: plain DataLoader vs the BackgroundGenerator recipe vs DataLoaderX.

A loop whose batches cost ``data`` ms of work to produce and ``step`` ms to train on (sleep,
GIL-releasing numpy, pure Python), over a grid of costs and queue depths: the wider grid behind
``python -m prefetchx bench``. Arms run in paired rounds in one process; figures are medians of
the per-round ratios, with their spread.

Usage:
    python benchmarks/thread_stage.py [--depths 1 2 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

from prefetchx.bench.cli import NO_RECIPE
from prefetchx.bench.synthetic import Case, as_rows, format_table, legend, machine_meta, measure

GRID = [
    Case("sleep", 5, 5, 100, rounds=5),
    Case("sleep", 2, 2, 200, rounds=5),
    Case("sleep", 10, 5, 60, rounds=5),
    Case("sleep", 5, 10, 60, rounds=5),
    Case("sleep", 0, 5, 60, rounds=5),
    Case("sleep", 5, 0, 60, rounds=5),
    Case("numpy", 5, 5, 60, rounds=5),
    Case("python", 5, 5, 60, rounds=5),
    Case("sleep", 0, 0, 20000, rounds=7, arms=("plain", "prefetchx"), note=NO_RECIPE),
    Case("sleep", 0, 0, 2000, note="shorter epochs, to run the recipe too"),
]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    meta = machine_meta()
    print(json.dumps(meta))
    runs = []
    for depth in args.depths:
        results = []
        for case in GRID:
            results.extend(measure(case, max_prefetch=depth))
        print(f"\nmax_prefetch={depth}")
        print(format_table(results), flush=True)
        print(legend(r.arm for r in results))
        runs.append({"max_prefetch": depth, "results": as_rows(results)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
