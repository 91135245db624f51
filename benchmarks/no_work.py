"""Where a loop with no work spends the time DataLoaderX adds to each batch (issue #16).

The no-work loop (no step, trivial items, no workers) is where DataLoaderX's own cost per batch
shows most: plain DataLoader takes about 40 us a batch there on the 2-core VM, so each
microsecond DataLoaderX adds is 2.5% of the loop. This program takes that cost apart, layer by
layer, and holds it against hand-offs that do less:

* ``source``: the DataLoader iterator DataLoaderX builds, iterated bare (what it adds before its
  stages: the sampler it records for ``state_dict``);
* ``stage``: the thread stage alone over a DataLoader iterator, with no thread and no choice
  (``max_prefetch=0``), iterated through its ``outlet`` as DataLoaderX's iterator does: the
  stall meter's bookkeeping, in counted windows;
* ``prefetchx``: DataLoaderX, the loop's own iterator;
* ``windows_5ms``: DataLoaderX with the counted windows it had before 2e6fad5, of 5 ms and 256
  batches at most rather than 20 ms and 4096: what a window's end costs, 4 times as often;
* ``generator``: a Python generator that yields the DataLoader iterator's batches;
* ``wrapper``: a class whose ``__next__`` calls the DataLoader iterator and appends one float to
  a list, the least a hand-off in Python that counts its batches can do;
* ``c_level``: an ``itertools.chain`` subclass over ``islice`` windows of the DataLoader
  iterator, with a Python generator run once per window of 256: a hand-off that runs no Python
  at all per batch.

The last three are not prefetchx: they are floors, measured in the same rounds, for what a
hand-off in Python and one with no Python per batch cost on this machine. Arms run in paired
rounds in one process (`prefetchx.bench.paired`); each figure is the median over rounds of the
arm's time per batch above plain's in the same round, and of the arm's throughput over plain's.

Usage:
    python benchmarks/no_work.py [--rounds 21] [--batches 3000] [--out STEM] [--quick]

``--out benchmarks/results/no_work-cpu-2core`` writes ``no_work-cpu-2core.txt`` (what it prints)
and ``no_work-cpu-2core.json`` (the figures and every round).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from prefetchx import DataLoaderX, ThreadStage, _thread_stage
from prefetchx.bench.paired import MIN_ROUNDS, Spread, ratios, run_rounds
from prefetchx.bench.synthetic import Work, WorkDataset, machine_meta

ARMS = {
    "plain": "DataLoader, the baseline",
    "source": "the DataLoader iterator DataLoaderX builds, iterated bare",
    "stage": "ThreadStage(max_prefetch=0)'s outlet over a DataLoader iterator: the meter, "
    "no thread",
    "prefetchx": "DataLoaderX",
    "windows_5ms": "DataLoaderX with counted windows of 5 ms (256 batches at most), as before "
    "2e6fad5",
    "generator": "floor: a Python generator over the DataLoader iterator",
    "wrapper": "floor: a class whose __next__ calls the DataLoader iterator and appends a float",
    "c_level": "floor: an itertools.chain subclass over islice windows (no Python per batch)",
}
FLOORS = ("generator", "wrapper", "c_level")
COLUMNS = {
    "us/batch": "the arm's time per batch, median over rounds",
    "above plain": "the arm's time per batch above plain's in the same round, median over rounds",
    "vs plain": "the arm's throughput over plain's, paired by round: median "
    "(lowest-highest); above 1.00x is faster",
}
WINDOW = 256
"""Batches in each of the ``c_level`` arm's windows."""


def _generator(source: Iterator[Any]) -> Iterator[Any]:
    yield from source


class _Wrapper:
    """A hand-off in Python that counts: one call and one append per batch."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._samples: list[float] = []
        self._add = self._samples.append

    def __iter__(self) -> _Wrapper:
        return self

    def __next__(self) -> Any:
        value = next(self._source)
        self._add(0.0)
        return value


class _CLevel(itertools.chain):  # type: ignore[type-arg]  # chain's own parameters
    """``itertools.chain`` over windows of ``WINDOW`` batches: the loop's ``next()`` runs C
    down to the DataLoader iterator's ``__next__``; Python runs once per window."""


def _c_level(source: Iterator[Any], batches: int) -> Iterator[Any]:
    def windows() -> Iterator[Iterable[Any]]:
        for _ in range(0, batches, WINDOW):
            yield itertools.islice(source, WINDOW)

    return _CLevel.from_iterable(windows())


def _timed(make: Callable[[], Iterable[Any]]) -> Callable[[], float]:
    """One epoch, timed from its first ``next()``: every arm's iterator is made before."""

    def run() -> float:
        iterable = make()
        start = time.perf_counter()
        for _ in iterable:
            pass
        return time.perf_counter() - start

    return run


def _with_windows(span: float, most: int, run: Callable[[], float]) -> Callable[[], float]:
    """``run`` with counted windows of ``span`` seconds and ``most`` batches at most."""

    def windowed() -> float:
        saved = _thread_stage.COARSE_SPAN_S, _thread_stage.COARSE_WINDOW
        _thread_stage.COARSE_SPAN_S, _thread_stage.COARSE_WINDOW = span, most
        try:
            return run()
        finally:
            _thread_stage.COARSE_SPAN_S, _thread_stage.COARSE_WINDOW = saved

    return windowed


def _bare_source(loader: DataLoaderX[Any]) -> Callable[[], Iterable[Any]]:
    def make() -> Iterable[Any]:
        source = iter(loader)._source  # its stages never start: dropping it stops nothing
        assert source is not None  # a new iterator has its DataLoader iterator
        return source

    return make


def arms(batches: int) -> dict[str, Callable[[], float]]:
    """Each arm: a call that runs one epoch of ``batches`` no-work batches, timed."""
    dataset = WorkDataset(batches, Work("sleep", 0))
    plain = DataLoader(dataset, batch_size=None)
    ours = DataLoaderX(dataset, batch_size=None)
    for _ in ours:  # the first epoch learns that the thread does not pay here
        pass
    return {
        "plain": _timed(lambda: iter(plain)),
        "source": _timed(_bare_source(ours)),
        "stage": _timed(lambda: ThreadStage(iter(plain), max_prefetch=0).outlet()),
        "prefetchx": _timed(lambda: iter(ours)),
        "windows_5ms": _with_windows(5e-3, 256, _timed(lambda: iter(ours))),
        "generator": _timed(lambda: _generator(iter(plain))),
        "wrapper": _timed(lambda: _Wrapper(iter(plain))),
        "c_level": _timed(lambda: _c_level(iter(plain), batches)),
    }


def measure(rounds: int, batches: int) -> dict[str, Any]:
    """Every arm's figures over ``rounds`` paired rounds of ``batches`` batches."""
    times = run_rounds(arms(batches), rounds)
    spreads = ratios(times)
    plain = times["plain"]
    out: dict[str, Any] = {}
    for name, arm in times.items():
        above = [(a - p) / batches * 1e6 for a, p in zip(arm, plain, strict=True)]
        out[name] = {
            "us_per_batch": statistics.median(arm) / batches * 1e6,
            "above_plain_us": statistics.median(above),
            "vs_plain": asdict(spreads[name]),
            "epochs_s": arm,
        }
    return out


def _spread(figures: dict[str, Any]) -> Spread:
    return Spread(**figures["vs_plain"])


def conclude(figures: dict[str, Any], quick: bool) -> str:
    """One sentence: DataLoaderX's cost, how much of it the stage is, what 5 ms windows
    cost, and the floors."""
    where = "On this machine (a --quick run: too short to quote)" if quick else "On this machine"
    ours, stage, old = figures["prefetchx"], figures["stage"], figures["windows_5ms"]
    floors = ", ".join(f"{name} {_spread(figures[name]).median:.3f}x" for name in FLOORS)
    return (
        f"{where}, DataLoaderX runs the no-work loop at {_spread(ours).median:.3f}x plain, "
        f"{ours['above_plain_us']:.2f} us a batch above it, of which the thread stage alone is "
        f"{stage['above_plain_us']:.2f} us (with 5 ms windows, {_spread(old).median:.3f}x and "
        f"{old['above_plain_us']:.2f} us); the floors run at {floors}."
    )


def render(meta: dict[str, Any], figures: dict[str, Any], conclusion: str) -> str:
    """The table, what its columns and arms mean, and the conclusion."""
    lines = [
        f"prefetchx {meta['prefetchx']}, torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['machine']}, {meta['cpus']} CPUs, commit {meta['commit']}",
        "",
        f"No-work loop: {meta['batches']} batches an epoch, {meta['rounds']} paired rounds, "
        "arms interleaved in one process",
        "",
        f"{'arm':<13}{'us/batch':>10}{'above plain':>13}  vs plain",
    ]
    for name in ARMS:
        f = figures[name]
        lines.append(
            f"{name:<13}{f['us_per_batch']:>10.2f}{f['above_plain_us']:>13.2f}  "
            f"{_spread(f).median:.3f}x ({_spread(f).low:.3f}-{_spread(f).high:.3f})"
        )
    lines += ["", "Columns:"]
    lines += [f"  {name}: {text}" for name, text in COLUMNS.items()]
    lines += ["Arms:"]
    lines += [f"  {name}: {text}" for name, text in ARMS.items()]
    lines += ["", conclusion]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="5 rounds of 300 batches (tests)")
    parser.add_argument("--out", metavar="STEM", help="write STEM.txt and STEM.json")
    args = parser.parse_args(argv)
    rounds, batches = (MIN_ROUNDS, 300) if args.quick else (args.rounds, args.batches)
    if rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}, got {rounds}")
    if batches < 1:
        parser.error(f"--batches must be at least 1, got {batches}")
    meta = {**machine_meta(), "rounds": rounds, "batches": batches, "quick": args.quick}
    figures = measure(rounds, batches)
    conclusion = conclude(figures, args.quick)
    text = render(meta, figures, conclusion)
    print(text, end="")
    if args.out:
        Path(f"{args.out}.txt").write_text(text)
        record = {"meta": meta, "arms": ARMS, "columns": COLUMNS, "figures": figures}
        record["conclusion"] = conclusion
        Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
