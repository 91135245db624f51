"""How a loop's pace moves after the thread stage switches between its thread and the loop alone.

The stage's chooser (`prefetchx._adapt`) decides from probes: a settling window of 4 batches,
then 4 to 16 measured ones, about 20 batches of the other mode against the incumbent's smoothed
figure. That tells the two modes apart only if a mode's pace shows within those batches. This
program checks it on one loop of the grid (`benchmarks/grid.py`): it runs the thread stage over a
DataLoader with the two modes forced to alternate in blocks of ``--block`` measured windows of 16
batches (each block after the stage's own settling batches: 4 for the thread, 1 for the loop
alone), for ``--seconds``, and times every window. The table gives each mode's median window by
its place in the block, counted from the switch: where a mode's pace takes longer than a probe to
settle, its first places differ from its last.

The grid's worst cell, numpy with 20 us of data and 20 us of step and 2 workers on the 2-core VM,
is such a loop: there the thread is 20% to 28% slower once settled, and about as fast as the loop
alone in the first windows after a switch (the records at 2bc0ac2). ``--pin`` puts this process
(and so its threads) on the first usable CPU and the workers on the others, which tells whether
the slow settling comes from where the OS scheduler places the threads and the worker processes.

Usage:
    python benchmarks/mode_trace.py [--kind numpy] [--data-us 20] [--step-us 20] [--workers 2]
        [--seconds 60] [--block 32] [--pin] [--quick] [--out STEM]

``--out benchmarks/results/mode_trace-cpu-2core`` writes ``mode_trace-cpu-2core.txt`` (the table
and its summary) and ``mode_trace-cpu-2core.json`` (every window: its time, mode, whether it was
a settling one, its batches and its time per batch; the machine, the versions and the commit).
``--quick`` is a run of seconds for tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from torch.utils.data import DataLoader

from prefetchx import ThreadStage, _thread_stage
from prefetchx._adapt import SETTLE, SETTLE_INLINE, WINDOW
from prefetchx.bench.record import meta_line, out_stem
from prefetchx.bench.synthetic import KINDS, Work, WorkDataset, machine_meta, release, wrap

PROBE_WINDOWS = 2
"""Windows after a switch that a probe's measured part spans, about (16 batches after 4)."""
MAX_PREFETCH = 2


class Window(NamedTuple):
    """One window the stage timed: when it ended, its mode, whether it was a settling one,
    its batches and the loop's time per batch over it, in seconds."""

    at: float
    threaded: bool
    settling: bool
    batches: int
    period: float


class Alternate:
    """A chooser for the thread stage that makes no choice: it starts with the loop alone and
    switches mode after every ``block`` measured windows, each switch followed by the stage's
    own settling window, and records every window in ``windows``."""

    def __init__(self, block: int, windows: list[Window]) -> None:
        self.block = block
        self.windows = windows
        self.threaded = False
        self.switches = 0
        self._settling = False
        self._measured = 0
        self._length = 0

    @property
    def steady(self) -> bool:
        """Never: the stage times every batch (no counted windows)."""
        return False

    def start(self) -> tuple[bool, int]:
        return self._run(False, WINDOW)

    def cut(self, length: int) -> None:
        self._length = length

    def window(
        self, period: float, means: Callable[[], tuple[float, float]], ending: bool = False
    ) -> tuple[bool, int]:
        at = time.perf_counter()
        self.windows.append(Window(at, self.threaded, self._settling, self._length, period))
        if self._settling:
            self._settling = False
            return self._run(self.threaded, WINDOW)
        self._measured += 1
        if self._measured < self.block:
            return self._run(self.threaded, WINDOW)
        self._measured = 0
        self.threaded = not self.threaded
        self.switches += 1
        self._settling = True
        return self._run(self.threaded, SETTLE if self.threaded else SETTLE_INLINE)

    def _run(self, threaded: bool, length: int) -> tuple[bool, int]:
        self._length = length
        return threaded, length


@contextmanager
def alternating(block: int, windows: list[Window]) -> Iterator[None]:
    """Thread stages made inside alternate their modes (`Alternate`) instead of choosing."""
    saved = _thread_stage.Chooser
    _thread_stage.Chooser = lambda memory: Alternate(block, windows)
    try:
        yield
    finally:
        _thread_stage.Chooser = saved


@contextmanager
def pinned(pin: bool) -> Iterator[Callable[[int], None] | None]:
    """With ``pin``: this thread (and the threads it starts) on the first usable CPU, and a
    ``worker_init_fn`` that puts a DataLoader worker on the others; the CPUs restored after."""
    if not pin:
        yield None
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"--pin needs 2 usable CPUs or more, this process has {len(cpus)}")
    main, rest = {cpus[0]}, set(cpus[1:])

    def to_the_others(worker_id: int) -> None:
        os.sched_setaffinity(0, rest)

    os.sched_setaffinity(0, main)
    try:
        yield to_the_others
    finally:
        os.sched_setaffinity(0, set(cpus))


def trace(
    kind: str, data_us: float, step_us: float, workers: int, seconds: float, block: int, pin: bool
) -> list[Window]:
    """Run the loop for ``seconds`` with the modes alternating; every window it timed."""
    data, step = Work(kind, data_us / 1e3), Work(kind, step_us / 1e3)
    windows: list[Window] = []
    with pinned(pin) as init:
        loader = DataLoader(
            WorkDataset(10**9, data),
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,
            worker_init_fn=init if workers else None,
        )
        try:
            with alternating(block, windows), ThreadStage(iter(loader), MAX_PREFETCH) as stage:
                end = time.perf_counter() + seconds
                for _ in stage:
                    step()
                    if time.perf_counter() > end:
                        break
        finally:
            release(loader)
    return windows


def blocks(windows: list[Window]) -> list[tuple[bool, list[float]]]:
    """The measured windows in runs of one mode: each block's mode and times per batch, the
    first and the last (cut short by the start and the end) left out."""
    runs: list[tuple[bool, list[float]]] = []
    for w in windows:
        if w.settling or w.batches != WINDOW:
            continue
        if runs and runs[-1][0] == w.threaded:
            runs[-1][1].append(w.period)
        else:
            runs.append((w.threaded, [w.period]))
    return runs[1:-1]


def by_place(runs: list[tuple[bool, list[float]]]) -> list[dict[str, Any]]:
    """Each mode's median window at each place since the switch, with its count."""
    places = min(len(periods) for _, periods in runs)
    rows = []
    for place in range(places):
        row: dict[str, Any] = {"place": place}
        for threaded, name in ((True, "thread"), (False, "alone")):
            at = [periods[place] for mode, periods in runs if mode == threaded]
            row[name] = statistics.median(at)
            row[f"{name}_n"] = len(at)
        rows.append(row)
    return rows


def paired(runs: list[tuple[bool, list[float]]], part: slice) -> float | None:
    """The thread's time per batch over the loop alone's, median over each thread block
    against the mean of the blocks either side, each over ``part`` of its windows."""
    ratios = []
    for before, (threaded, periods), after in zip(runs, runs[1:], runs[2:], strict=False):
        if threaded and not before[0] and not after[0]:
            alone = (statistics.fmean(before[1][part]) + statistics.fmean(after[1][part])) / 2
            ratios.append(statistics.fmean(periods[part]) / alone)
    return statistics.median(ratios) if ratios else None


def stray(runs: list[tuple[bool, list[float]]]) -> float:
    """How far a window strays from the one before it in its block, median, as a share."""
    steps = [abs(math.log(b / a)) for _, p in runs for a, b in itertools.pairwise(p)]
    return statistics.median(steps) if steps else math.nan


def summarize(windows: list[Window]) -> dict[str, Any]:
    runs = blocks(windows)
    if sum(1 for threaded, _ in runs if threaded) < 1 or len(runs) < 3:
        raise ValueError(
            f"too few blocks to pair ({len(runs)} whole ones): run longer or with a smaller --block"
        )
    size = min(len(periods) for _, periods in runs)
    first, settled = slice(0, min(PROBE_WINDOWS, size)), slice(size // 2, size)
    return {
        "blocks": len(runs),
        "block_windows": size,
        "places": by_place(runs),
        "first": paired(runs, first),
        "settled": paired(runs, settled),
        "stray": stray(runs),
        "batch_ms": statistics.median(w.period for w in windows) * 1e3,
    }


def _fmt(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"


def conclude(figures: dict[str, Any], quick: bool) -> str:
    first, settled = figures["first"], figures["settled"]
    if first is None or settled is None:
        return "Too few blocks of each mode to compare them."
    span_ms = figures["block_windows"] * WINDOW * figures["batch_ms"]
    text = (
        f"On this machine, the thread's time per batch over the loop alone's is "
        f"{first:.3f} in the first {PROBE_WINDOWS} windows after a switch (what a probe sees) and "
        f"{settled:.3f} once settled (the second half of blocks of about {span_ms:.0f} ms)"
    )
    gap_first, gap_settled = first - 1, settled - 1
    if abs(gap_settled - gap_first) > max(0.03, abs(gap_settled) / 2):
        text += ": a probe misreads this loop."
    else:
        text += ": a probe reads this loop as it settles."
    if quick:
        text += " (A quick run: too few blocks to conclude from.)"
    return text


def render(meta: dict[str, Any], figures: dict[str, Any], conclusion: str) -> str:
    batch_ms = figures["batch_ms"]
    pin = ", pinned (this process on one CPU, the workers on the others)" if meta["pin"] else ""
    lines = [
        meta_line(meta),
        "",
        f"{meta['kind']}, D {meta['data_us']:g} us, C {meta['step_us']:g} us, "
        f"{meta['workers']} workers{pin}; {meta['seconds']:g} s, the modes alternating in "
        f"{figures['blocks']} blocks of {figures['block_windows']} measured windows of {WINDOW} "
        f"batches",
        "",
        f"{'place':>5} {'after ms':>8} {'thread us':>10} {'alone us':>9} {'thread/alone':>12}",
    ]
    for row in figures["places"]:
        after = row["place"] * WINDOW * batch_ms
        lines.append(
            f"{row['place']:>5} {after:>8.0f} {row['thread'] * 1e6:>10.0f} "
            f"{row['alone'] * 1e6:>9.0f} {row['thread'] / row['alone']:>12.3f}"
        )
    lines += [
        "",
        f"thread / alone, paired (each thread block against the blocks either side): "
        f"first {PROBE_WINDOWS} windows {_fmt(figures['first'])}, second half "
        f"{_fmt(figures['settled'])}; a window strays {figures['stray']:.1%} from the one "
        f"before it (median)",
        "",
        "Columns:",
        wrap(
            "place: the measured window's place in its block, counted from the switch (0: the "
            "first after the settling batches)."
        ),
        wrap("after ms: about how long after the switch it began, at the loop's median pace."),
        wrap(
            "thread us, alone us: the median time per batch of the windows at that place, with "
            "the thread making the batches, and with the loop making its own."
        ),
        "",
        wrap(conclusion, indent=""),
    ]
    return "\n".join(lines) + "\n"


def checked(kind: type, what: str, zero: bool = False) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` above 0 (or 0 and above, with ``zero``), else an error that
    says ``what`` it must be and echoes the value."""

    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None
        if not (number >= 0 if zero else number > 0):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
        return number

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", choices=[k for k in KINDS if k != "none"], default="numpy")
    cost = checked(float, "a number >= 0", zero=True)
    parser.add_argument("--data-us", type=cost, default=20.0, metavar="US")
    parser.add_argument("--step-us", type=cost, default=20.0, metavar="US")
    workers = checked(int, "an integer >= 0", zero=True)
    parser.add_argument("--workers", type=workers, default=2, metavar="N")
    seconds = checked(float, "a number above 0")
    parser.add_argument("--seconds", type=seconds, default=60.0, metavar="S")
    parser.add_argument("--block", type=checked(int, "an integer above 0"), default=32, metavar="N")
    parser.add_argument(
        "--pin", action="store_true", help="this process on one CPU, the workers on the others"
    )
    parser.add_argument("--quick", action="store_true", help="a run of seconds (tests)")
    parser.add_argument("--out", type=out_stem, metavar="STEM", help="write STEM.txt and STEM.json")
    args = parser.parse_args(argv)
    if args.pin and not args.workers:
        parser.error("--pin places the workers: give --workers 1 or more")
    seconds, block = (2.0, 4) if args.quick else (args.seconds, args.block)
    meta = {**machine_meta(), "kind": args.kind, "data_us": args.data_us}
    meta |= {"step_us": args.step_us, "workers": args.workers, "seconds": seconds}
    meta |= {"block": block, "pin": args.pin, "quick": args.quick}
    try:
        windows = trace(
            args.kind, args.data_us, args.step_us, args.workers, seconds, block, args.pin
        )
        figures = summarize(windows)
    except ValueError as exc:
        print(f"mode_trace.py: {exc}", file=sys.stderr)
        return 2
    conclusion = conclude(figures, args.quick)
    text = render(meta, figures, conclusion)
    print(text, end="")
    if args.out:
        Path(f"{args.out}.txt").write_text(text)
        # Microseconds for the clock, nanoseconds for a batch: what the timer resolves here.
        windows_rows = [
            [round(w.at, 6), w.threaded, w.settling, w.batches, round(w.period, 9)] for w in windows
        ]
        record = {
            "meta": meta,
            "figures": figures,
            "conclusion": conclusion,
            "windows": windows_rows,
        }
        Path(f"{args.out}.json").write_text(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
