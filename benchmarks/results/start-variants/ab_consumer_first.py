"""A/B in one process: DataLoaderX with the thread started as now, against the thread waiting
for a go-ahead given once Thread.start has returned (consumer-first), in paired rounds.

    python benchmarks/results/start-variants/ab_consumer_first.py [--rounds 11] [--cells K,D,C ...]

Tried at 7c06311 and not landed (RESULTS.md, "Consumer-first, measured in DataLoaderX as it is").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
from typing import Any

from torch.utils.data import DataLoader

import prefetchx._producer as P
from prefetchx import DataLoaderX
from prefetchx.bench.paired import run_rounds
from prefetchx.bench.synthetic import RecipeLoader, Work, WorkDataset, release, run_epoch

CF = {"on": False}
_start, _run = P.Producer.start, P.Producer.run


def start(self: Any) -> None:
    self._go = threading.Event()
    if not CF["on"]:
        self._go.set()
    try:
        _start(self)
    finally:
        self._go.set()


def run(self: Any) -> None:
    self._go.wait()
    _run(self)


P.Producer.start, P.Producer.run = start, run  # type: ignore[method-assign]

CELLS = [
    "python,20,20",
    "python,200,0",
    "python,200,20",
    "python,10000,20",
    "sleep,200,200",
    "numpy,200,200",
    "numpy,2000,2000",
    "sleep,2000,200",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--epoch-ms", type=float, default=250)
    ap.add_argument("--cells", nargs="+", default=CELLS)
    args = ap.parse_args()
    for spec in args.cells:
        kind, d, c = spec.split(",")
        d_ms, c_ms = float(d) / 1e3, float(c) / 1e3
        n = max(20, int(args.epoch_ms / (d_ms + c_ms + 0.015)))
        data, step = Work(kind, d_ms), Work(kind, c_ms)
        ds = WorkDataset(n, data)
        loaders = {
            "plain": DataLoader(ds, batch_size=None),
            "old": DataLoaderX(ds, batch_size=None, device="cpu"),
            "cf": DataLoaderX(ds, batch_size=None, device="cpu"),
            "recipe": RecipeLoader(ds, batch_size=None),
        }

        def epoch(name: str, loaders: dict[str, Any] = loaders, step: Work = step) -> float:
            CF["on"] = name == "cf"
            try:
                return run_epoch(loaders[name], step)
            finally:
                CF["on"] = False

        for name in loaders:
            epoch(name)
        times = run_rounds({k: functools.partial(epoch, k) for k in loaders}, args.rounds)
        for lo in loaders.values():
            release(lo)
        line = [f"{spec:>16} n={n:4d}"]
        for name in ("old", "cf", "recipe"):
            r = [p / t for p, t in zip(times["plain"], times[name], strict=True)]
            line.append(f"{name} {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})")
        r = [o / t for o, t in zip(times["old"], times["cf"], strict=True)]
        line.append(f"cf/old {statistics.median(r):.3f}")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
