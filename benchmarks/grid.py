"""The grid: DataLoaderX against a plain DataLoader over per-batch data and step costs.

Each cell is a loop whose dataset spends ``D`` per batch and whose step spends ``C``, of one
kind of work (`prefetchx.bench.synthetic.Work`: sleeping, numpy, pure Python), with 0 or 2
persistent DataLoader workers; ``D`` and ``C`` each take 0, 20 us, 200 us, 2 ms and 10 ms. Three
step shapes follow with 200 us of data: ``bimodal`` (each step 20 us or 2 ms, at random),
``phases`` (64 steps of 20 us, then 64 of 2 ms, and again: evaluation-like phases) and ``ramp``
(from 0 to 2 ms over the epoch, as a warm-up).

Seven arms run in one process over the same dataset, in paired rounds
(`prefetchx.bench.paired`): plain DataLoader, DataLoaderX, the BackgroundGenerator recipe,
DataLoaderX with ``max_prefetch=0``, a run-ahead ``queue.SimpleQueue`` thread over DataLoader
(the floor of a threaded hand-off), and a second plain DataLoader and a second recipe, each
against its first: the noise of the targets' two comparisons. Each arm runs one untimed epoch
first (workers started). Every cell reports each arm's throughput over plain's; the summary
gives the figures issue #16's targets are about. A cell within 1% of a target (DataLoaderX below
0.98, or in a winning cell the second recipe) gets a second look: plain, DataLoaderX, the recipe
and the two twins measured in ``--second-rounds`` fresh rounds (with workers, four epochs an arm
a round), from which the summary reads it; the first look's figures stay in the table and in
the record.

Usage:
    python benchmarks/grid.py [--quick] [--rounds N] [--second-rounds N] [--epoch-ms MS]
        [--only REGEX] [--out STEM]

``--only`` runs the cells whose label (as the table gives it: ``sleep ramp, D 200 us, C 995.2
us, 0 workers``) matches a regular expression, with the hand-off; with ``--epoch-ms``, it
measures how a loop's length changes a cell. A shaped cell's C is the mean of its steps over an
epoch, whose length is sized from the DataLoader cost this run measures: it can differ from one
run's table to the next, so match it loosely (``python phases, .*, 2 workers``).

``--out benchmarks/results/grid-cpu-2core`` writes ``grid-cpu-2core.txt`` (the table, its
legend and summary) and ``grid-cpu-2core.json`` (every round's times, the machine, the versions
and the commit). ``--quick`` is a run of seconds for tests: a few cells, short epochs.
"""

from __future__ import annotations

import argparse
import functools
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from prefetchx import ThreadStage
from prefetchx.bench.paired import CLEAR, MIN_ROUNDS, Spread, ratios, run_rounds
from prefetchx.bench.record import add_options, meta_line, report, rounds
from prefetchx.bench.synthetic import (
    ARMS,
    KINDS,
    VS_PLAIN,
    Work,
    WorkDataset,
    conclude,
    explain,
    machine_meta,
    release,
    run_epoch,
    wrap,
)

COSTS_MS = (0.0, 0.02, 0.2, 2.0, 10.0)
WORKERS = (0, 2)
SHAPES = ("bimodal", "phases", "ramp")
SHAPE_DATA_MS = 0.2
SHORT_MS, LONG_MS = 0.02, 2.0
PHASE = 64
"""Steps in each phase of the ``phases`` shape."""
RAMP_LEVELS = 8
"""The ``ramp`` shape's steps take this many distinct costs (each a calibrated `Work`)."""
HANDOFF_BATCHES = {False: 20000, True: 500}
"""Batches of the hand-off loop, a full run's and a quick one's."""
DEEPER = (4, 8, 32)
"""Queue depths the hand-off is also measured at, beyond the run's ``--max-prefetch``: a deeper
queue lets the thread make more batches for each wake-up (see `prefetchx._engine.Channel`)."""
ARM_ORDER = ("plain", "prefetchx", "recipe", "inline", "floor", "again", "recipe again")
SECOND_LOOK_ARMS = ("plain", "prefetchx", "recipe", "again", "recipe again")
"""The arms a second look measures again: those the targets read."""
SECOND_LOOK_BELOW = 0.98
"""A cell gets a second look where DataLoaderX reads below this, over plain or, in a winning
cell, over the best of plain and the recipe (or the second recipe does there): within 1% of the
targets' 0.97. Five rounds leave a cell's median a few percent of noise (plain against itself
reads below 0.97 in several cells of a run), so a cell near the line is measured again in fresh
rounds, and the targets are read from that measurement; both are recorded."""
SECOND_LOOK_ROUNDS = 11
SECOND_LOOK_EPOCHS = {0: 1, 2: 4}
"""Epochs each arm runs back to back in a round of a cell's second look, by worker count: a
round is timed over their sum. With 2 workers three processes share the cores, and which runs
when moves one 250 ms epoch by 20% either way (plain against itself read 0.72x to 1.51x a round,
medians of 11 rounds 0.90x to 1.09x). The 22 worker cells that read lowest, timed over 1 s
epochs, read 0.965x plain at the lowest where they read 0.864x over 250 ms, one below 0.97
against five of plain against itself; four epochs a round time as long. Repeating the epoch, not
lengthening it, keeps a shaped step (a ramp over the epoch) the loop it was."""
OVERHEAD_MS = {0: 0.03, 2: 0.15}
"""A DataLoader's own cost per batch, roughly, without and with workers, where it is not
measured (`loader_overhead_ms`): sizes the epochs. With workers it varies by machine: 0.15 ms on
one 2-core VM, 1 ms on another."""
OVERHEAD_BATCHES = 400
"""Batches of the no-work epoch that measures a DataLoader's own cost per batch."""

SHAPE_NOTES = {
    "constant": "every step costs C",
    "bimodal": f"each step costs {SHORT_MS * 1e3:g} us or {LONG_MS:g} ms, at random, C the mean",
    "phases": f"{PHASE} steps of {SHORT_MS * 1e3:g} us, then {PHASE} of {LONG_MS:g} ms, and "
    "again (evaluation-like phases); C the mean",
    "ramp": f"steps grow from 0 to {LONG_MS:g} ms over the epoch (a warm-up); C the mean",
}

COLUMNS = {
    "kind": "the work in the dataset and in the step: sleep (releases the GIL, as I/O), numpy "
    "(GIL-releasing array work), python (holds the GIL), none (no work at all)",
    "wkr": "DataLoader workers, persistent",
    "D us": "the dataset's work per batch, nominal",
    "C us": "the step's work per batch, nominal (the mean, for a shape)",
    "C got": "the step's work per batch as measured in the plain arm (a short sleep overshoots)",
    "shape": "how the step's cost varies over the epoch: "
    + "; ".join(f"{name}: {note}" for name, note in SHAPE_NOTES.items()),
    "batches": "batches per epoch, sized so that the plain arm's epoch takes about --epoch-ms",
    "ARM": f"(one column per arm) {VS_PLAIN}",
}


@dataclass
class Cell:
    """One loop of the grid."""

    kind: str
    workers: int
    data_ms: float
    step_ms: float
    shape: str = "constant"
    batches: int = 0

    @property
    def label(self) -> str:
        """A short name, as the summary gives it."""
        costs = f"D {self.data_ms * 1e3:g} us, C {self.step_ms * 1e3:g} us"
        shape = "" if self.shape == "constant" else f" {self.shape}"
        return f"{self.kind}{shape}, {costs}, {self.workers} workers"

    def steps_ms(self) -> list[float]:
        """The step's cost for each batch of an epoch, in ms."""
        n = self.batches
        if self.shape == "bimodal":
            draws = np.random.default_rng(16).random(n)
            return [SHORT_MS if u < 0.5 else LONG_MS for u in draws]
        if self.shape == "phases":
            return [SHORT_MS if i // PHASE % 2 == 0 else LONG_MS for i in range(n)]
        if self.shape == "ramp":
            return [round(i * RAMP_LEVELS / n) * LONG_MS / RAMP_LEVELS for i in range(n)]
        return [self.step_ms] * n


class Steps:
    """A step whose work follows a schedule of costs, one per batch; `restart` each epoch."""

    def __init__(self, kind: str, schedule: list[float]) -> None:
        works = {ms: Work(kind, ms) for ms in set(schedule)}
        self.works = list(works.values())
        self.schedule = [works[ms] for ms in schedule]
        self.done = 0

    def restart(self) -> None:
        self.done = 0
        for work in self.works:
            work.calls.clear()

    def spent(self) -> float:
        """Seconds the step's work took since the last `restart`."""
        return sum(work.spent for work in self.works)

    def __call__(self) -> None:
        self.schedule[self.done % len(self.schedule)]()
        self.done += 1


def loader_overhead_ms(workers: int, batches: int = OVERHEAD_BATCHES) -> float:
    """A DataLoader's own time per batch on this machine, in ms: an epoch of no work, after an
    untimed one (persistent workers started)."""
    dataset = WorkDataset(batches, Work("sleep", 0.0))
    loader = DataLoader(
        dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0
    )
    try:
        for _ in loader:
            pass
        start = time.perf_counter()
        for _ in loader:
            pass
        return (time.perf_counter() - start) / batches * 1e3
    finally:
        release(loader)


def grid(
    quick: bool, epoch_ms: float, overhead_ms: Mapping[int, float] = OVERHEAD_MS
) -> list[Cell]:
    """The cells to run, each with its epoch length, from a DataLoader's own cost per batch at
    each worker count, ``overhead_ms``."""
    if quick:  # one cell of each sort the summary reads, and a shape
        return _sized(
            [
                Cell("none", 0, 0.0, 0.0),
                Cell("sleep", 0, 0.0, 0.2),
                Cell("sleep", 0, 0.2, 0.2),
                Cell("python", 0, 0.2, 0.2),
                Cell("sleep", 0, SHAPE_DATA_MS, LONG_MS / 2, "bimodal"),
            ],
            epoch_ms,
            overhead_ms,
        )
    cells = []
    for w in WORKERS:
        cells.append(Cell("none", w, 0.0, 0.0))
        for kind in KINDS:
            cells += [Cell(kind, w, d, c) for d in COSTS_MS for c in COSTS_MS if d or c]
        for kind in KINDS:
            cells += [Cell(kind, w, SHAPE_DATA_MS, LONG_MS / 2, shape) for shape in SHAPES]
    return _sized(cells, epoch_ms, overhead_ms)


def _sized(cells: list[Cell], epoch_ms: float, overhead_ms: Mapping[int, float]) -> list[Cell]:
    """``cells`` with their epoch lengths set from the time a batch should take."""
    for cell in cells:
        per_batch = cell.data_ms + cell.step_ms + overhead_ms[cell.workers]
        least = 2 * PHASE if cell.shape == "phases" else 20
        cell.batches = max(least, min(20000, round(epoch_ms / per_batch)))
        if cell.shape != "constant":  # about LONG_MS / 2 until the epoch's length is known
            cell.step_ms = round(statistics.fmean(cell.steps_ms()), 4)
    return cells


def measure_cell(
    cell: Cell,
    rounds: int,
    max_prefetch: int,
    progress: Callable[[str], None],
    arms: tuple[str, ...] = ARM_ORDER,
    epochs: int = 1,
) -> dict[str, Any]:
    """The ``arms`` on ``cell``: one untimed epoch each, then ``rounds`` paired rounds, each
    arm running ``epochs`` epochs back to back in a round, timed together."""
    kind = "sleep" if cell.kind == "none" else cell.kind
    data = Work(kind, cell.data_ms)
    steps = Steps(kind, cell.steps_ms())
    dataset = WorkDataset(cell.batches, data)
    common = {
        "batch_size": None,
        "num_workers": cell.workers,
        "persistent_workers": cell.workers > 0,
    }
    loaders = {arm: ARMS[arm](dataset, max_prefetch, common) for arm in arms}
    step_calls: list[float] = []
    data_calls: list[float] = []

    def epoch(arm: str, loader: Iterable[Any]) -> float:
        steps.restart()
        data.calls.clear()
        seconds = run_epoch(loader, steps)
        if arm == "plain":
            step_calls.append(steps.spent() / cell.batches)
            if data.calls:  # in this process only without workers
                data_calls.append(sum(data.calls) / len(data.calls))
        return seconds

    def turn(arm: str, loader: Iterable[Any]) -> float:
        return sum(epoch(arm, loader) for _ in range(epochs))

    try:
        for arm, loader in loaders.items():
            epoch(arm, loader)
        step_calls.clear()
        data_calls.clear()
        times = run_rounds(
            {arm: functools.partial(turn, arm, loader) for arm, loader in loaders.items()},
            rounds,
            lambda done: progress(f"  {cell.label}: round {done}/{rounds}"),
        )
    finally:
        for loader in loaders.values():
            release(loader)
    extra = {
        arm: statistics.median(
            (t - p) / (cell.batches * epochs) * 1e6
            for t, p in zip(times[arm], times["plain"], strict=True)
        )
        for arm in arms
    }
    return {
        **asdict(cell),
        "label": cell.label,
        "step_call_ms": statistics.median(step_calls) * 1e3 if any(step_calls) else 0.0,
        "data_call_ms": statistics.median(data_calls) * 1e3 if data_calls else None,
        "epochs_s": times,
        "ratios": {arm: asdict(spread) for arm, spread in ratios(times).items()},
        "extra_us_per_batch": extra,
        "epochs_per_round": epochs,
    }


class ForcedThread:
    """The thread stage over a DataLoader on its own, with no decision to park its thread, so a
    loop with no work times the hand-off alone: every batch after the first comes from the
    thread."""

    def __init__(self, loader: Iterable[Any], max_prefetch: int) -> None:
        self.loader = loader
        self.max_prefetch = max_prefetch

    def __iter__(self) -> ThreadStage[Any]:
        return ThreadStage(iter(self.loader), self.max_prefetch)


def _switches() -> int:
    """Context switches of this process so far, its ended threads' included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def measure_handoff(
    batches: int, rounds: int, max_prefetch: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """What a threaded hand-off costs: a loop with no work at all over plain DataLoader, the
    thread stage with no decision (every batch handed over), and the floor (a run-ahead
    SimpleQueue thread), in paired rounds; per arm, the time per batch above plain's and the
    context switches per batch. The thread stage is also measured at the `DEEPER` depths, in
    the same rounds."""
    dataset = WorkDataset(batches, Work("sleep", 0.0))
    deeper = [d for d in DEEPER if d > max_prefetch]
    loaders: dict[str, Iterable[Any]] = {
        "plain": DataLoader(dataset, batch_size=None),
        "thread": ForcedThread(DataLoader(dataset, batch_size=None), max_prefetch),
        "floor": ARMS["floor"](dataset, max_prefetch, {"batch_size": None}),
        **{f"depth {d}": ForcedThread(DataLoader(dataset, batch_size=None), d) for d in deeper},
    }
    switches: dict[str, list[float]] = {arm: [] for arm in loaders}

    def epoch(arm: str) -> float:
        before = _switches()
        seconds = run_epoch(loaders[arm], _nothing)
        switches[arm].append((_switches() - before) / batches)
        return seconds

    for arm in loaders:
        epoch(arm)
        switches[arm].clear()
    times = run_rounds(
        {arm: functools.partial(epoch, arm) for arm in loaders},
        rounds,
        lambda done: progress(f"  hand-off: round {done}/{rounds}"),
    )
    extra = {
        arm: statistics.median(
            (t - p) / batches * 1e6 for t, p in zip(times[arm], times["plain"], strict=True)
        )
        for arm in loaders
    }
    per_batch = {arm: statistics.median(v) for arm, v in switches.items()}
    floor = extra["floor"]

    def over_floor(us: float) -> float | None:
        return us / floor if floor > 0 else None

    main_arms = ("plain", "thread", "floor")
    return {
        "batches": batches,
        "max_prefetch": max_prefetch,
        "epochs_s": times,
        "extra_us_per_batch": {arm: extra[arm] for arm in main_arms},
        "switches_per_batch": {arm: per_batch[arm] for arm in main_arms},
        "thread_over_floor": over_floor(extra["thread"]),
        "depths": {
            str(d): {
                "extra_us_per_batch": extra[f"depth {d}"],
                "switches_per_batch": per_batch[f"depth {d}"],
                "over_floor": over_floor(extra[f"depth {d}"]),
            }
            for d in deeper
        },
    }


def _nothing() -> None:
    pass


def _spread(cell: dict[str, Any], arm: str) -> Spread:
    return Spread(**cell["ratios"][arm])


def of_best(cell: dict[str, Any], arm: str = "prefetchx") -> float:
    """``arm`` against the best of plain and the recipe in a winning cell (where the recipe is
    the best): the median, over the rounds, of the recipe's epoch over ``arm``'s in the same
    round. Paired so, the two arms share each round's state of the machine. The ratio of their
    two medians over plain does not: at f18081b, Python 20/20 us with 2 workers read 0.899 so,
    and 0.997 paired. A cell recorded without its epochs is read from those medians."""
    epochs = cell.get("epochs_s")
    if epochs is not None and arm in epochs and "recipe" in epochs:
        return ratios(epochs, base="recipe")[arm].median
    return _spread(cell, arm).median / max(1.0, _spread(cell, "recipe").median)


def second_look_due(cell: dict[str, Any]) -> bool:
    """Whether ``cell`` reads close enough to a 0.97 target to be measured again (see
    `SECOND_LOOK_BELOW`). In a winning cell, the second recipe reading that close is a reason
    too: the summary then reads both arms against the best from the same rounds wherever
    either read low, and the second recipe's figure stays a fair measure of the noise there."""
    if _spread(cell, "prefetchx").median < SECOND_LOOK_BELOW:
        return True
    if _spread(cell, "recipe").median <= 1 + CLEAR:
        return False
    twin = "recipe again" in cell["ratios"] and of_best(cell, "recipe again") < SECOND_LOOK_BELOW
    return of_best(cell) < SECOND_LOOK_BELOW or twin


def settled(cell: dict[str, Any]) -> dict[str, Any]:
    """``cell`` as the targets read it: with its second look's figures, where it had one."""
    second = cell.get("second_look")
    if second is None:
        return cell
    return {**cell, "ratios": second["ratios"], "epochs_s": second.get("epochs_s")}


def summarize(
    cells: list[dict[str, Any]], handoff: dict[str, Any], second_rounds: int = 0
) -> dict[str, Any]:
    """The figures the targets of issue #16 are about (see `SUMMARY_NOTES`), each cell read
    from its second look (of ``second_rounds`` rounds) where it had one; and the same from the
    first look alone."""
    summary = summarize_cells([settled(c) for c in cells])
    summary["second_look"] = {
        "cells": sum(1 for c in cells if "second_look" in c),
        "rounds": second_rounds,
        "first_look": summarize_cells(cells),
    }
    summary["handoff"] = summarize_handoff(handoff)
    return summary


def summarize_cells(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The cells' part of `summarize`."""
    ours = [(c, _spread(c, "prefetchx")) for c in cells]
    worst, worst_spread = min(ours, key=lambda pair: pair[1].median)
    no_work = next((c for c in cells if c["kind"] == "none" and c["workers"] == 0), None)
    # Cells where prefetching pays (the recipe beats plain clearly): DataLoaderX against the
    # best of plain and the recipe there.
    winning = [(c, of_best(c)) for c in cells if _spread(c, "recipe").median > 1 + CLEAR]
    summary: dict[str, Any] = {
        "worst": {"cell": worst["label"], **asdict(worst_spread)},
        "no_work": None,
        "winning_cells": len(winning),
        "winning_worst": None,
    }
    if no_work is not None:
        summary["no_work"] = {"cell": no_work["label"], **no_work["ratios"]["prefetchx"]}
    if winning:
        cell, share = min(winning, key=lambda pair: pair[1])
        summary["winning_worst"] = {
            "cell": cell["label"],
            "of_best": share,
            "below_0.97": sum(1 for _, s in winning if s < 0.97),
        }
        summary["winning_noise"] = winning_noise([c for c, _ in winning])
    again = [(c, _spread(c, "again")) for c in cells]
    lowest, lowest_spread = min(again, key=lambda pair: pair[1].median)
    summary["noise"] = {
        "cell": lowest["label"],
        **asdict(lowest_spread),
        "below_0.97": sum(1 for _, s in again if s.median < 0.97),
        "prefetchx_below_0.97": sum(1 for _, s in ours if s.median < 0.97),
        "in_worst_cell": asdict(_spread(worst, "again")),
    }
    return summary


def winning_noise(winning: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The winning cells' target read for the recipe against itself: the second recipe
    against the first, paired by round as DataLoaderX is (`of_best`), its lowest and how many
    fall below 0.97. An arm as fast as the recipe falls below the line by this much at random.
    ``None`` where the cells have no such arm (records before it)."""
    twins = [(c, of_best(c, "recipe again")) for c in winning if "recipe again" in c["ratios"]]
    if not twins:
        return None
    cell, share = min(twins, key=lambda pair: pair[1])
    return {
        "cell": cell["label"],
        "of_best": share,
        "below_0.97": sum(1 for _, s in twins if s < 0.97),
        "cells": len(twins),
    }


def summarize_handoff(handoff: dict[str, Any]) -> dict[str, Any]:
    """The hand-off's figures for the summary."""
    return {
        "thread_us": handoff["extra_us_per_batch"]["thread"],
        "floor_us": handoff["extra_us_per_batch"]["floor"],
        "thread_over_floor": handoff["thread_over_floor"],
        "thread_switches": handoff["switches_per_batch"]["thread"],
        "floor_switches": handoff["switches_per_batch"]["floor"],
        "depths": {d: m["over_floor"] for d, m in handoff["depths"].items()},
    }


SUMMARY_NOTES = (
    "worst cell: DataLoaderX's lowest median throughput over plain in the grid (target >= 0.97)",
    "noise: the same for the arm 'again', a second plain DataLoader (plain against itself): its "
    "lowest median, its cells below 0.97 against DataLoaderX's, and its figure in DataLoaderX's "
    "worst cell. A cell of DataLoaderX's below 0.97 tells little where plain against itself "
    "reads as low",
    "no-work loop: DataLoaderX over plain with no work, no workers (target >= 0.95)",
    "winning cells: where the recipe beats plain by more than 2%, DataLoaderX against the best "
    "of plain and the recipe, which is the recipe there: the median over the rounds of the "
    "recipe's epoch over DataLoaderX's in the same round; the lowest (target >= 0.97); then the "
    "same for the arm 'recipe again', a second recipe (the recipe against itself): an arm as "
    "fast as the recipe reads that low at random",
    f"second look: the cells where DataLoaderX read below {SECOND_LOOK_BELOW} at the first look "
    "(over plain, or in a winning cell over the best of plain and the recipe, where the second "
    "recipe reading as low counts too), within 1% of a target, measured again in fresh "
    f"paired rounds of the arms the targets read (with workers, {SECOND_LOOK_EPOCHS[2]} epochs "
    "an arm a round, timed together); the lines "
    "above read those cells from their second look, and this line gives the same figures from "
    "the first look alone",
    "hand-off: a loop with no work and no workers, timed apart: the time per batch above plain's "
    "(paired by round) and the context switches per batch of the thread stage on its own (every "
    "batch handed over by its thread) and of the floor; the first over the second; then the "
    "thread stage at deeper queues",
)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as text, each line with what it means."""
    lines = ["Summary:"]
    worst = summary["worst"]
    lines.append(wrap(f"worst cell: {worst['median']:.2f}x plain ({worst['cell']})"))
    noise = summary["noise"]
    lines.append(
        wrap(
            f"noise: plain against itself {_ratio(noise)} at the lowest ({noise['cell']}), "
            f"{_ratio(noise['in_worst_cell'])} in the worst cell above; {noise['below_0.97']} "
            f"cells below 0.97 (DataLoaderX: {noise['prefetchx_below_0.97']})"
        )
    )
    if summary["no_work"] is not None:
        no_work = Spread(**{k: summary["no_work"][k] for k in ("median", "low", "high", "rounds")})
        lines.append(wrap(f"no-work loop: {no_work.ratio()} plain"))
    if summary["winning_worst"] is not None:
        w = summary["winning_worst"]
        lines.append(
            wrap(
                f"winning cells: {summary['winning_cells']}; the lowest, {w['of_best']:.3f} of "
                f"the best of plain and the recipe ({w['cell']}); {w['below_0.97']} below 0.97"
                + _twin_clause(summary.get("winning_noise"))
            )
        )
    else:
        lines.append(wrap("winning cells: none (the recipe beat plain by more than 2% nowhere)"))
    lines.append(wrap(_second_look_line(summary["second_look"])))
    h = summary["handoff"]
    over = (
        f"{h['thread_over_floor']:.2f}x the floor's"
        if h["thread_over_floor"] is not None
        else "the floor's is not above 0"
    )
    lines.append(
        wrap(
            f"hand-off: the thread stage {h['thread_us']:.1f} us a batch above plain "
            f"({h['thread_switches']:.2f} switches a batch), the floor {h['floor_us']:.1f} us "
            f"({h['floor_switches']:.2f}): {over}"
        )
    )
    if h["depths"]:
        lines.append(wrap("hand-off, deeper queues, over the floor's: " + _by_depth(h["depths"])))
    lines.append("What the summary lines mean:")
    lines += [wrap(note) for note in SUMMARY_NOTES]
    return "\n".join(lines)


def _twin_clause(twin: dict[str, Any] | None) -> str:
    """The recipe against itself in the winning cells, for the summary's line."""
    if twin is None:
        return ""
    return (
        f"; the recipe against itself {twin['of_best']:.3f} at the lowest ({twin['cell']}), "
        f"{twin['below_0.97']} below 0.97"
    )


def _second_look_line(second: dict[str, Any]) -> str:
    first = second["first_look"]
    worst = first["worst"]
    line = (
        f"second look: {second['cells']} cells, {second['rounds']} rounds each; at the first "
        f"look alone, the worst cell {worst['median']:.2f}x plain ({worst['cell']}), "
        f"DataLoaderX below 0.97 in {first['noise']['prefetchx_below_0.97']} cells (plain "
        f"against itself in {first['noise']['below_0.97']})"
    )
    if first["winning_worst"] is not None:
        w = first["winning_worst"]
        line += f", winning cells below 0.97 of the best: {w['below_0.97']} of "
        line += f"{first['winning_cells']}, the lowest {w['of_best']:.3f}"
        twin = first.get("winning_noise")
        if twin is not None:
            line += f" (the recipe against itself: {twin['below_0.97']}, {twin['of_best']:.3f})"
    return line


def format_second_look(cells: list[dict[str, Any]]) -> str:
    """One line per cell measured again: DataLoaderX's first figure, then the second look's."""
    arms = SECOND_LOOK_ARMS[1:]
    head = f"{'cell':<52} {'prefetchx, first':<18}  " + " ".join(f"{arm:<18}" for arm in arms)
    lines = [
        "Second look (see the summary): DataLoaderX's first figure, then each arm's in the "
        "second look's rounds (with workers, "
        f"{SECOND_LOOK_EPOCHS[2]} epochs an arm a round)",
        head.rstrip(),
    ]
    for c in cells:
        if "second_look" not in c:
            continue
        again = settled(c)
        lines.append(
            (
                f"{c['label']:<52} {_spread(c, 'prefetchx').ratio():<18}  "
                + " ".join(f"{_spread(again, a).ratio():<18}" for a in arms)
            ).rstrip()
        )
    return "\n".join(lines)


def _ratio(figures: dict[str, Any]) -> str:
    """A spread's median and range, from its fields in a summary."""
    return Spread(**{k: figures[k] for k in ("median", "low", "high", "rounds")}).ratio()


def _times(over: float | None) -> str:
    """A ratio to the floor, or ``-`` where the floor's cost is not above 0."""
    return "-" if over is None else f"{over:.2f}x"


def _by_depth(depths: dict[str, float | None]) -> str:
    return ", ".join(f"max_prefetch={d} {_times(over)}" for d, over in depths.items())


def format_handoff(handoff: dict[str, Any]) -> str:
    """The hand-off alone (``--handoff-only``), each line with what it means."""
    summary = summarize_handoff(handoff)
    lines = [
        f"Hand-off: {handoff['batches']} batches with no work and no workers, "
        f"{len(handoff['epochs_s']['plain'])} paired rounds"
    ]
    lines.append(
        wrap(
            f"max_prefetch={handoff['max_prefetch']}: the thread stage "
            f"{summary['thread_us']:.1f} us a batch above plain ({summary['thread_switches']:.2f}"
            f" switches a batch), the floor {summary['floor_us']:.1f} us "
            f"({summary['floor_switches']:.2f})"
        )
    )
    for d, m in handoff["depths"].items():
        lines.append(
            wrap(
                f"max_prefetch={d}: the thread stage {m['extra_us_per_batch']:.1f} us a batch "
                f"above plain ({m['switches_per_batch']:.2f} switches a batch)"
            )
        )
    lines.append(
        wrap(
            f"over the floor's: max_prefetch={handoff['max_prefetch']} "
            + _times(summary["thread_over_floor"])
            + (", " + _by_depth(summary["depths"]) if summary["depths"] else "")
            + " (target <= 1.5 at the default depth)"
        )
    )
    lines.append(wrap(SUMMARY_NOTES[-1]))
    return "\n".join(lines)


def format_table(cells: list[dict[str, Any]]) -> str:
    """One line per cell: its costs, then each arm's throughput over plain."""
    arms = ARM_ORDER[1:]
    head = (
        f"{'kind':<6} {'wkr':>3} {'D us':>6} {'C us':>7} {'C got':>7} {'shape':<8} "
        f"{'batches':>7}  " + " ".join(f"{arm:<18}" for arm in arms)
    )
    lines = [head.rstrip()]
    for c in cells:
        lines.append(
            (
                f"{c['kind']:<6} {c['workers']:>3} {c['data_ms'] * 1e3:>6g} "
                f"{c['step_ms'] * 1e3:>7.4g} {c['step_call_ms'] * 1e3:>7.0f} {c['shape']:<8} "
                f"{c['batches']:>7}  " + " ".join(f"{_spread(c, a).ratio():<18}" for a in arms)
            ).rstrip()
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of this program."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a few cells, short epochs (for tests)")
    p.add_argument(
        "--epoch-ms",
        type=float,
        default=250.0,
        metavar="MS",
        help="the plain arm's epoch length to aim for (default 250; --quick: 20)",
    )
    p.add_argument(
        "--only",
        type=label_pattern,
        metavar="REGEX",
        help="run only the cells whose label matches REGEX (re.search), e.g. 'ramp.*, 0 workers'",
    )
    p.add_argument(
        "--handoff-only",
        action="store_true",
        help="measure the hand-off alone, at the run's depth and deeper (a minute)",
    )
    p.add_argument(
        "--second-rounds",
        type=second_rounds,
        metavar="N",
        help=f"paired rounds of a second look at the cells near a target, >= {MIN_ROUNDS}, or "
        f"0 for none (default {SECOND_LOOK_ROUNDS}; --quick: {MIN_ROUNDS})",
    )
    add_options(p, "benchmarks/results/grid-cpu-2core")
    return p


def label_pattern(value: str) -> re.Pattern[str]:
    """An argparse type for ``--only``: a regular expression."""
    try:
        return re.compile(value)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression ({exc}): {value!r}") from exc


def second_rounds(value: str) -> int:
    """An argparse type for ``--second-rounds``: 0, or as ``--rounds``."""
    return 0 if value.strip() == "0" else rounds(value)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    epoch_ms = 20.0 if args.quick else args.epoch_ms
    meta = {
        **machine_meta(),
        "rounds": args.rounds,
        "epoch_ms": epoch_ms,
        "max_prefetch": args.max_prefetch,
        "quick": args.quick,
    }
    print(meta_line(meta), flush=True)
    started = time.perf_counter()
    log = functools.partial(print, file=sys.stderr, flush=True)
    if args.handoff_only:
        handoff = measure_handoff(HANDOFF_BATCHES[args.quick], args.rounds, args.max_prefetch, log)
        report(
            args.out,
            {**meta, "handoff_only": True},
            [format_handoff(handoff)],
            f"The threaded hand-off costs {_times(handoff['thread_over_floor'])} the floor's "
            f"at max_prefetch={args.max_prefetch} on this machine.",
            {},
            ("plain", "floor"),
            handoff=handoff,
            summary=summarize_handoff(handoff),
        )
        return 0
    workers = (0,) if args.quick else WORKERS  # the quick cells have none
    overhead = {w: loader_overhead_ms(w, 40 if args.quick else OVERHEAD_BATCHES) for w in workers}
    meta["overhead_ms"] = overhead
    cells = grid(args.quick, epoch_ms, overhead)
    if args.only is not None:
        cells = [cell for cell in cells if args.only.search(cell.label)]
        if not cells:
            parser().error(f"--only matches no cell's label: {args.only.pattern!r}")
        meta["only"] = args.only.pattern
    results = []
    for i, cell in enumerate(cells):
        log(f"cell {i + 1}/{len(cells)}")
        results.append(measure_cell(cell, args.rounds, args.max_prefetch, log))
    looks = args.second_rounds
    if looks is None:
        looks = MIN_ROUNDS if args.quick else SECOND_LOOK_ROUNDS
    meta["second_rounds"] = looks
    pairs = zip(cells, results, strict=True)
    due = [(cell, r) for cell, r in pairs if looks and second_look_due(r)]
    for i, (cell, result) in enumerate(due):
        log(f"second look {i + 1}/{len(due)}")
        epochs = SECOND_LOOK_EPOCHS[cell.workers]
        again = measure_cell(cell, looks, args.max_prefetch, log, SECOND_LOOK_ARMS, epochs)
        result["second_look"] = {
            k: again[k] for k in ("epochs_s", "ratios", "extra_us_per_batch", "epochs_per_round")
        }
    log("hand-off")
    handoff = measure_handoff(HANDOFF_BATCHES[args.quick], args.rounds, args.max_prefetch, log)
    summary = summarize(results, handoff, looks)
    conclusion = conclude(
        [(c["label"], _spread(settled(c), "prefetchx")) for c in results], quick=args.quick
    )
    report(
        args.out,
        meta,
        [
            f"Grid: {len(cells)} cells, {args.rounds} paired rounds each, then a second look "
            f"at {len(due)} of them, {looks} rounds each; arms interleaved in one process; "
            f"{time.perf_counter() - started:.0f} s in all. Epochs sized from a "
            "DataLoader's own time a batch, measured: "
            + ", ".join(f"{ms * 1e3:.0f} us with {w} workers" for w, ms in overhead.items()),
            format_table(results),
            *([format_second_look(results)] if due else []),
            explain(COLUMNS, ARM_ORDER),
            format_summary(summary),
        ],
        conclusion,
        COLUMNS,
        ARM_ORDER,
        cells=results,
        handoff=handoff,
        summary=summary,
        summary_notes=list(SUMMARY_NOTES),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
