"""Command line: ``python -m prefetchx bench`` (or ``prefetchx bench``)."""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from prefetchx import __version__
from prefetchx._bench import Case, as_rows, format_table, measure

DEFAULT_GRID = [Case(5, 5, 100), Case(10, 5, 60), Case(5, 10, 60), Case(0, 0, 2000)]
QUICK_GRID = [Case(5, 5, 40), Case(0, 0, 500)]


def _bench(args: argparse.Namespace) -> int:
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    rounds = 3 if args.quick else args.rounds
    print(
        f"prefetchx {__version__}, torch {torch.__version__}, Python {platform.python_version()}"
        f", {platform.machine()}",
        flush=True,
    )
    print(
        f"Sleeping data and step costs; arms interleaved; medians of {rounds} rounds.", flush=True
    )
    results = []
    for case in grid:
        results.extend(
            measure(
                case,
                rounds,
                max_prefetch=args.max_prefetch,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            )
        )
    print(format_table(results))
    if args.json:
        meta = {
            "prefetchx": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.platform(),
            "rounds": rounds,
            "max_prefetch": args.max_prefetch,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": as_rows(results)}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prefetchx`` command."""
    parser = argparse.ArgumentParser(prog="prefetchx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure what prefetching saves on this machine")
    bench.add_argument("--quick", action="store_true", help="a smaller grid, in seconds")
    bench.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    bench.add_argument("--max-prefetch", type=int, default=2, help="queue depth of the threads")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
