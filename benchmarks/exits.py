"""How fast every way out of an epoch is, DataLoaderX against DataLoader, in the same run (#63).

Each scenario runs a plain `DataLoader` and a `DataLoaderX` in turn, ``--trials`` times each, and
reports medians and maxima:

* ``exception``: an exception raised in the loop's step (as Ctrl-C would be) after a few
  batches: how long until the ``except`` has it, and until the worker processes and prefetchx's
  threads are all gone. Without workers (items of 30 ms) and with 2 (items of 0.5 s, so that a
  worker is inside an item when the loop leaves).
* ``killed worker``: a worker is killed mid-epoch: how long until the loop gets DataLoader's
  error, and how long the next epoch's first batch then takes.

DataLoaderX runs with its thread on from the second batch, as a new loader does. Times are wall
clock, so a loaded machine stretches both arms alike; read them side by side.

Usage:
    python benchmarks/exits.py [--trials N] [--quick] [--out STEM]

``--out STEM`` writes ``STEM.txt`` (the table, the machine, the versions and the commit on its
first line) and ``STEM.json`` (every trial's times).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from torch.utils.data import DataLoader, Dataset

from prefetchx import DataLoaderX
from prefetchx.bench.record import meta_line
from prefetchx.bench.synthetic import machine_meta

ARMS: dict[str, type[DataLoader[Any]]] = {"DataLoader": DataLoader, "DataLoaderX": DataLoaderX}


class Slow(Dataset[int]):
    """``n`` items, each taking ``seconds`` to make."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.seconds)
        return i


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]


def _gone(deadline: float) -> float:
    """Seconds until this process has no child process and no prefetchx thread, from now."""
    start = time.perf_counter()
    me = psutil.Process()
    while time.perf_counter() - start < deadline:
        children = [c for c in me.children() if c.status() != psutil.STATUS_ZOMBIE]
        if not children and not _threads():
            break
        time.sleep(0.005)
    return time.perf_counter() - start


def exception_trial(kind: type[DataLoader[Any]], workers: int, seconds: float) -> dict[str, float]:
    """An exception in the step after 3 batches: seconds until it is caught, and until every
    worker and thread is gone after that."""
    loader = kind(Slow(1000, seconds), batch_size=1, num_workers=workers)
    raised = caught = 0.0
    try:
        for i, _ in enumerate(loader):
            if i == 3:
                raised = time.perf_counter()
                raise ValueError("the step failed")
    except ValueError:
        caught = time.perf_counter()
    return {"caught_s": caught - raised, "gone_s": caught - raised + _gone(30.0)}


def killed_trial(kind: type[DataLoader[Any]], workers: int, seconds: float) -> dict[str, float]:
    """A worker killed after 3 batches: seconds until the loop gets the error, and the next
    epoch's first batch."""
    loader = kind(Slow(200, seconds), batch_size=1, num_workers=workers)
    it = iter(loader)
    for _ in range(3):
        next(it)
    os.kill(it._workers[0].pid, signal.SIGKILL)
    killed = time.perf_counter()
    error = float("nan")
    try:
        while True:
            next(it)
    except RuntimeError:
        error = time.perf_counter() - killed
    del it
    start = time.perf_counter()
    next(iter(loader))
    return {"error_s": error, "next_epoch_s": time.perf_counter() - start}


SCENARIOS: dict[str, tuple[Callable[..., dict[str, float]], int, float]] = {
    "exception, no workers, items of 30 ms": (exception_trial, 0, 0.03),
    "exception, 2 workers, items of 0.5 s": (exception_trial, 2, 0.5),
    "killed worker, 2 workers, items of 20 ms": (killed_trial, 2, 0.02),
}


def run(trials: int) -> dict[str, Any]:
    """Every scenario, each arm in turn, ``trials`` times."""
    results: dict[str, Any] = {}
    for name, (trial, workers, seconds) in SCENARIOS.items():
        got: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for t in range(trials):
            for arm in list(ARMS)[t % 2 :] + list(ARMS)[: t % 2]:
                got[arm].append(trial(ARMS[arm], workers, seconds))
        results[name] = got
        print(f"  {name}: done", flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    lines = []
    for name, got in results.items():
        lines.append(f"{name}:")
        for arm, trials in got.items():
            figures = []
            for key in trials[0]:
                values = [t[key] for t in trials]
                figures.append(
                    f"{key[:-2]} {statistics.median(values):.3f} s (max {max(values):.3f})"
                )
            lines.append(f"  {arm:12s} " + ", ".join(figures))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 trials: a run of seconds")
    parser.add_argument("--out", type=Path, metavar="STEM")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error(f"--trials must be >= 1, got {args.trials}")
    trials = 2 if args.quick else args.trials
    meta = {**machine_meta(), "trials": trials, "quick": args.quick}
    results = run(trials)
    text = f"{meta_line(meta)}\n\n{table(results)}\n"
    print(text)
    if args.out is not None:
        Path(f"{args.out}.txt").write_text(text)
        Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "results": results}))


if __name__ == "__main__":
    main()
