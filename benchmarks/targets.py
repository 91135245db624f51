"""The thread stage's performance targets, each measured as the median of several runs.

1. Overlap efficiency with D = C = 5 ms sleeps (target >= 0.97), median of 5 runs.
2. Throughput with no step work and trivial batches, DataLoaderX over plain DataLoader
   (target >= 0.95, issue #16; it was 0.90), median of 5 runs.
3. The stall meter's cost: the same no-work loop over ThreadStage with max_prefetch=0 (no
   thread: only the meter's bookkeeping) against the bare iterator, per batch.

Usage:
    python benchmarks/targets.py [--runs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from prefetchx import ThreadStage
from prefetchx.bench.synthetic import Case, machine_meta, measure


def _meter_cost_us(n: int = 200_000, rounds: int = 7) -> float:
    """Per-item cost of ThreadStage's inline path (the meter's bookkeeping) over a bare iterator."""
    bare, metered = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in iter(range(n)):
            pass
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in ThreadStage(iter(range(n)), max_prefetch=0):
            pass
        metered.append(time.perf_counter() - start)
    return (statistics.median(metered) - statistics.median(bare)) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    meta = {**machine_meta(), "runs": args.runs}
    print(json.dumps(meta), flush=True)
    overlap, recipe_overlap, ratio = [], [], []
    for run in range(args.runs):
        rows = {r.arm: r for r in measure(Case("sleep", 5, 5, 50, rounds=5))}
        overlap.append(rows["prefetchx"].overlap_efficiency)
        recipe_overlap.append(rows["recipe"].overlap_efficiency)
        rows = {
            r.arm: r
            for r in measure(Case("sleep", 0, 0, 20000, rounds=7, arms=("plain", "prefetchx")))
        }
        ratio.append(rows["prefetchx"].speedup)
        print(
            f"run {run + 1}: overlap {overlap[-1]:.3f} (recipe {recipe_overlap[-1]:.3f}), "
            f"no-work throughput {ratio[-1]:.3f}x plain",
            flush=True,
        )
    meter = _meter_cost_us()
    summary = {
        "overlap_efficiency_sleep_5_5": statistics.median(overlap),
        "recipe_overlap_efficiency_sleep_5_5": statistics.median(recipe_overlap),
        "no_work_throughput_vs_plain": statistics.median(ratio),
        "meter_cost_us_per_batch": meter,
        "runs": {"overlap": overlap, "recipe_overlap": recipe_overlap, "no_work": ratio},
    }
    print(f"\nmedian of {args.runs} runs:")
    print(
        f"  overlap efficiency, D = C = 5 ms sleeps: {summary['overlap_efficiency_sleep_5_5']:.3f}"
        f" (target >= 0.97; recipe {summary['recipe_overlap_efficiency_sleep_5_5']:.3f})"
    )
    print(
        f"  no-step-work throughput: {summary['no_work_throughput_vs_plain']:.3f}x plain "
        "(target >= 0.95)"
    )
    print(f"  stall meter + stage bookkeeping: {meter:.2f} us per batch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
