"""How often DataLoaderX keeps the slower mode of a loop, over fresh loaders: the loop alone
where a thread is faster, or the thread where the loop alone is (issue #16).

The grid's numpy ramp without workers climbs in every epoch. Its steps grow from 0 to 2 ms in 8
levels over about 200 batches, with 200 us of numpy data a batch. A thread is faster there all
through: 1.13x to 1.16x plain on the 2-core VM. But each probe of the thread runs while the steps
climb, and a run can keep the loop alone for epoch after epoch. Which way a run goes is settled
early and by chance, so one cell of the grid (5 rounds in one process) lands either way. This
program counts it over many runs. ``--shape`` runs the grid's other uneven numpy loops instead:
``phases`` (64 steps of 20 us, then 64 of 2 ms) or ``bimodal``. ``--workers 2`` gives these loops
2 workers, as the grid's cells with workers have, where on the 2-core VM the workers take every
CPU and the stage weighs its two modes over whole epochs (``prefetchx._adapt.SLOW_WINDOW_S``).

``--shape python`` runs the mirror: the bench's pure-Python loop, 5 ms of Python in the dataset
and in the step, where the thread is slower (both hold the GIL) and the fault is a run that keeps
it. There the program counts the epochs that kept the thread, not the loop alone.

``--shape workers`` runs the grid's worst cell at 8f9189c: numpy, 20 us of data and 20 us of
step a batch, 2 persistent workers. The thread is slower there too (the recipe read 0.84x
plain, DataLoaderX 0.86x, ``max_prefetch=0`` 1.02x), and each epoch reads from 0.75x to 1.2x
plain by itself as the workers' pace drifts: the program counts the epochs that kept the thread.

Each run builds fresh loaders of the loop, so each DataLoaderX starts with nothing learnt. It
times ``--epochs`` epochs of each arm, interleaved in the order of a Williams design
(`prefetchx.bench.paired.round_order`: over twice as many epochs as arms, each arm runs in each
place, and right after each other arm, equally often). The order used to be reversed at every
other epoch, which ran the last arm twice in a row at every other epoch's end. Run against an
identical copy of itself (``--before``), the chooser in that place kept the thread more: 45 and
53 of 150 epochs of the pure-Python loop, against 33 and 34, and 44 of 168 of the loop with
workers, against 23. The arms:

* ``plain``: DataLoader, the baseline;
* ``prefetchx``: DataLoaderX;
* ``thread``: the thread stage over DataLoader with no choice made (``adaptive=False``), over
  workers making every batch as DataLoaderX's does (``steal=False``): what the thread gives
  (left out with ``--no-thread``: its epochs between the others' change how often a chooser
  keeps the loop alone, and a training loop has no such arm);
* ``before`` (with ``--before PATH``): DataLoaderX with its choice made by another copy of
  ``prefetchx/_adapt.py``, such as the code before a change
  (``git show REV:prefetchx/_adapt.py > PATH``), measured in the same runs;
* ``recipe`` (with ``--recipe``): the BackgroundGenerator recipe over DataLoader, which the
  grid weighs DataLoaderX's winning cells against.

``--cell KIND,D,C`` runs one constant loop of the grid instead of a shape: KIND (sleep, numpy
or python), D us of data and C us of step a batch, with ``--workers`` workers. Which of its modes
is the slower one is read from the run: the loop alone where the thread arm beat plain, the
thread otherwise, so ``--cell`` needs the thread arm.

A DataLoaderX epoch counts as the loop kept alone when its stage ends the epoch with the loop
making the batches itself (the incumbent the loader remembers), and as the thread kept
otherwise. Figures are taken over the epochs after each run's first. For each arm: its
throughput over plain's in the same epoch, median and mean. For the DataLoaderX arms, also: the
share of epochs that kept the slower mode of the loop (the loop alone; the thread with
``--shape python`` or ``workers``), and the runs that kept it `IN_A_ROW` epochs in a row or more.

Usage:
    python benchmarks/kept_alone.py [--runs 40] [--epochs 8] [--epoch-ms 250] [--shape ramp]
        [--cell KIND,D,C] [--workers 0] [--before PATH] [--no-thread] [--recipe] [--quick]
        [--out STEM]

``--out benchmarks/results/kept_alone-cpu-2core`` writes ``kept_alone-cpu-2core.txt`` (what it
prints) and ``kept_alone-cpu-2core.json`` (every epoch's time and mode, the machine, the
versions and the commit). ``--quick`` is a run of seconds for tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import grid  # benchmarks/grid.py, beside this program

from prefetchx import _thread_stage
from prefetchx.bench.paired import round_order
from prefetchx.bench.record import integer_at_least, meta_line
from prefetchx.bench.synthetic import ARMS as LOADERS
from prefetchx.bench.synthetic import Work, WorkDataset, machine_meta, release, run_epoch

ARMS = {
    "plain": "DataLoader, the baseline",
    "prefetchx": "DataLoaderX",
    "thread": "the thread stage over DataLoader, no choice made (adaptive=False)",
    "before": "DataLoaderX with the chooser of --before PATH",
    "recipe": "the BackgroundGenerator recipe over DataLoader (--recipe)",
}
CHOOSERS = ("prefetchx", "before")
"""The arms whose stage chooses between the thread and the loop."""
IN_A_ROW = 4
"""Epochs in a row that keeping the slower mode must last for a run to count."""
MAX_PREFETCH = 2
PYTHON = "python"
"""The ``--shape`` of the pure-Python loop, where the loop alone is the faster mode."""
PYTHON_MS = 5.0
"""The pure-Python loop's data and step per batch, as in the bench (`prefetchx.bench`)."""
WORKERS = "workers"
"""The ``--shape`` of the loop with workers where the thread is slower (the grid's worst cell)."""
THREAD_SLOWER = (PYTHON, WORKERS)
"""The ``--shape``s whose slower mode is the thread."""
CELL = "cell"
"""The shape a ``--cell`` run records: one constant loop, its slower mode read from the run."""
CELL_KINDS = ("sleep", "numpy", "python")


def load_chooser(path: str) -> ModuleType:
    """A copy of ``prefetchx/_adapt.py`` at ``path``, loaded as a module of its own; a
    `ValueError` that says why if it cannot be."""
    if not Path(path).is_file():
        raise ValueError(f"no file {path!r}")
    spec = importlib.util.spec_from_file_location("kept_alone_before", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in ("Chooser", "Memory") if not hasattr(module, name)]
    if missing:
        raise ValueError(f"{path!r} has no {' or '.join(missing)}: give a copy of _adapt.py")
    return module


def fresh_memory(module: ModuleType) -> Any:
    """A new `Memory` of ``module``, a copy of ``prefetchx/_adapt.py``. One from before the
    loader told its memory how slowly the loop settles (``settle_s``, which that chooser does not
    read) gets room for it."""
    memory = module.Memory
    if "settle_s" not in getattr(memory, "__slots__", ("settle_s",)):
        memory = type(memory.__name__, (memory,), {"__slots__": ("settle_s", "settle_left")})
    return memory()


@contextmanager
def choosing(module: ModuleType | None) -> Iterator[None]:
    """The thread stage makes its choices with ``module``'s `Chooser` (none: its own)."""
    saved = _thread_stage.Chooser
    if module is not None:
        _thread_stage.Chooser = module.Chooser
    try:
        yield
    finally:
        _thread_stage.Chooser = saved


def the_loop(shape: str, epoch_ms: float, workers: int = 0) -> grid.Cell:
    """The grid's numpy loop of steps shaped ``shape`` with ``workers`` workers, or with
    `PYTHON` the pure-Python loop, or with `WORKERS` the numpy loop of 20 us and 20 us with 2
    workers, its epoch sized to about ``epoch_ms``."""
    if shape == PYTHON:
        cell = grid.Cell(PYTHON, 0, PYTHON_MS, PYTHON_MS)
    elif shape == WORKERS:
        cell = grid.Cell("numpy", 2, 0.02, 0.02)
    else:
        cell = grid.Cell("numpy", workers, grid.SHAPE_DATA_MS, grid.LONG_MS / 2, shape)
    return sized(cell, epoch_ms)


def sized(cell: grid.Cell, epoch_ms: float) -> grid.Cell:
    """``cell`` with its epoch sized to about ``epoch_ms``, from the grid's rough cost of a
    DataLoader's batch without workers and with them, whatever their number."""
    overhead = grid.OVERHEAD_MS[2 if cell.workers else 0]
    return grid._sized([cell], epoch_ms, {cell.workers: overhead})[0]


def one_run(
    cell: grid.Cell,
    epochs: int,
    before: ModuleType | None,
    thread: bool = True,
    start: int = 0,
    recipe: bool = False,
) -> dict[str, Any]:
    """Fresh loaders of ``cell``, ``epochs`` interleaved epochs of each arm: every epoch's
    seconds, and for the DataLoaderX arms whether the loop alone ended it. The epochs follow
    the design's rounds from ``start`` on (a run's number: runs of fewer epochs than the
    design's cycle then share its places out)."""
    data, steps = Work(cell.kind, cell.data_ms), grid.Steps(cell.kind, cell.steps_ms())
    dataset = WorkDataset(cell.batches, data)
    workers = cell.workers
    common = {"batch_size": None, "num_workers": workers, "persistent_workers": workers > 0}
    plain, ours = (LOADERS[arm](dataset, MAX_PREFETCH, common) for arm in ("plain", "prefetchx"))
    loaders: dict[str, Iterable[Any]] = {"plain": plain, "prefetchx": ours}
    if thread:
        plain_too = LOADERS["plain"](dataset, MAX_PREFETCH, common)
        # Over workers, as DataLoaderX's: the thread makes every batch (`Pipeline.fed_by`).
        forced = grid.ForcedThread(plain_too, MAX_PREFETCH, steal=workers == 0)
        loaders["thread"] = forced
    if recipe:
        loaders["recipe"] = LOADERS["recipe"](dataset, MAX_PREFETCH, common)
    modules: dict[str, ModuleType | None] = {arm: None for arm in loaders}
    if before is not None:
        loaders["before"] = LOADERS["prefetchx"](dataset, MAX_PREFETCH, common)
        loaders["before"]._pipeline.memory = fresh_memory(before)
        modules["before"] = before
    seconds: dict[str, list[float]] = {arm: [] for arm in loaders}
    alone: dict[str, list[bool]] = {arm: [] for arm in loaders if arm in CHOOSERS}
    try:
        for epoch in range(epochs):
            names = list(loaders)
            for arm in (names[index] for index in round_order(len(names), start + epoch)):
                steps.restart()
                with choosing(modules[arm]):
                    seconds[arm].append(run_epoch(loaders[arm], steps))
                if arm in alone:
                    memory = loaders[arm]._pipeline.memory
                    alone[arm].append(memory.threaded is False)
    finally:
        for loader in loaders.values():
            release(loader.loader if isinstance(loader, grid.ForcedThread) else loader)
    return {"epochs_s": seconds, "alone": alone}


def longest(flags: list[bool]) -> int:
    """The longest stretch of ``True`` in ``flags``."""
    best = now = 0
    for flag in flags:
        now = now + 1 if flag else 0
        best = max(best, now)
    return best


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each arm's figures over the epochs after each run's first (see the module's doc)."""
    figures: dict[str, dict[str, Any]] = {}
    for arm in runs[0]["epochs_s"]:
        vs_plain = [
            p / t
            for run in runs
            for p, t in zip(run["epochs_s"]["plain"][1:], run["epochs_s"][arm][1:], strict=True)
        ]
        figure: dict[str, Any] = {
            "vs_plain_median": statistics.median(vs_plain),
            "vs_plain_mean": statistics.fmean(vs_plain),
        }
        if arm in CHOOSERS:
            kept = [run["alone"][arm][1:] for run in runs]
            threaded = [[not alone for alone in k] for k in kept]
            figure["alone_epochs"] = sum(map(sum, kept))
            figure["thread_epochs"] = sum(map(sum, threaded))
            figure["epochs"] = sum(map(len, kept))
            figure["alone_runs"] = sum(longest(k) >= IN_A_ROW for k in kept)
            figure["thread_runs"] = sum(longest(t) >= IN_A_ROW for t in threaded)
            figure["runs"] = len(kept)
        figures[arm] = figure
    return figures


class Slower(NamedTuple):
    """The slower mode of a loop, which the program counts, as its figures and text name it."""

    prefix: str
    """Of its figures: ``{prefix}_epochs``, ``{prefix}_runs``."""
    heading: str
    what: str
    doing: str


SLOWER = {
    "alone": Slower("alone", "loop kept alone", "the loop alone", "the loop making its batches"),
    "thread": Slower("thread", "thread kept", "the thread", "its thread making the batches"),
}


def counted(shape: str, figures: dict[str, Any] | None = None) -> Slower:
    """The slower mode of the loop ``shape``: the thread in the pure-Python loop and the one
    with workers, the loop alone in the numpy ones without; for a `CELL`, the loop alone where
    the thread arm of ``figures`` beat plain, the thread otherwise."""
    if shape == CELL:
        if figures is None or "thread" not in figures:
            raise ValueError("a --cell run reads its slower mode from the thread arm")
        return SLOWER["alone" if figures["thread"]["vs_plain_median"] > 1.0 else "thread"]
    return SLOWER["thread" if shape in THREAD_SLOWER else "alone"]


def cell_of(value: str) -> tuple[str, float, float]:
    """An argparse type for ``--cell``: KIND,D,C with D and C in microseconds."""
    parts = value.split(",")
    if len(parts) != 3 or parts[0] not in CELL_KINDS:
        raise argparse.ArgumentTypeError(
            f"expected KIND,D,C with KIND one of {', '.join(CELL_KINDS)}, got {value!r}"
        )
    try:
        data_us, step_us = float(parts[1]), float(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(f"D and C must be numbers of us, got {value!r}") from None
    if not (data_us >= 0 and step_us >= 0):
        raise argparse.ArgumentTypeError(f"D and C must be 0 or more, got {value!r}")
    return parts[0], data_us, step_us


def render(meta: dict[str, Any], cell: grid.Cell, figures: dict[str, Any], conclusion: str) -> str:
    slower = counted(meta["shape"], figures)
    mode = slower.prefix
    lines = [
        meta_line(meta),
        "",
        f"{cell.label}, {cell.batches} batches an epoch; {meta['runs']} runs of "
        f"{meta['epochs']} epochs, figures over the epochs after each run's first",
        "",
        f"{'arm':<10} {'vs plain':>9} {'mean':>6}  {slower.heading}",
    ]
    for arm, f in figures.items():
        kept = ""
        if "epochs" in f:
            n = f[f"{mode}_epochs"]
            kept = (
                f"{n}/{f['epochs']} epochs ({n / f['epochs']:.0%}),"
                f" {f[f'{mode}_runs']}/{f['runs']} runs for {IN_A_ROW}+ in a row"
            )
        lines.append(
            f"{arm:<10} {f['vs_plain_median']:>8.3f}x {f['vs_plain_mean']:>6.3f}  {kept}".rstrip()
        )
    lines += [
        "",
        "vs plain: the arm's throughput over plain's in the same epoch, median; mean: their mean",
        f"{slower.heading}: epochs the stage ended with {slower.doing}, the slower mode here; "
        f"runs that did so for {IN_A_ROW} epochs in a row or more",
        "",
        conclusion,
    ]
    return "\n".join(lines) + "\n"


def conclude(figures: dict[str, Any], quick: bool, shape: str) -> str:
    slower = counted(shape, figures)
    mode = slower.prefix
    ours = figures["prefetchx"]
    text = (
        f"DataLoaderX kept {slower.what} in {ours[f'{mode}_epochs']} of {ours['epochs']} epochs "
        f"and in {ours[f'{mode}_runs']} of {ours['runs']} runs for {IN_A_ROW} epochs or more, at "
        f"{ours['vs_plain_median']:.3f}x plain"
    )
    if "thread" in figures:
        text += f" where the thread kept on gives {figures['thread']['vs_plain_median']:.3f}x"
    if "recipe" in figures:
        text += f" and the recipe {figures['recipe']['vs_plain_median']:.3f}x"
    text += "."
    if "before" in figures:
        b = figures["before"]
        text += (
            f" The chooser of --before: {b[f'{mode}_epochs']} of {b['epochs']} epochs, "
            f"{b[f'{mode}_runs']} of {b['runs']} runs, {b['vs_plain_median']:.3f}x plain."
        )
    if quick:
        text += " (A quick run: too few epochs to conclude from.)"
    return text


at_least_two = integer_at_least(2)
"""Runs and epochs: a run's first epoch is not counted."""
worker_count = integer_at_least(0)
"""DataLoader workers."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=at_least_two, default=40, metavar="N")
    parser.add_argument("--epochs", type=at_least_two, default=8, metavar="N")
    parser.add_argument("--epoch-ms", type=float, default=250.0, metavar="MS")
    parser.add_argument(
        "--shape",
        choices=(*grid.SHAPES, *THREAD_SLOWER),
        default="ramp",
        help="the numpy steps' shape (default ramp), or python: the pure-Python loop, or "
        "workers: numpy, 20 us and 20 us, 2 workers",
    )
    parser.add_argument(
        "--cell",
        type=cell_of,
        metavar="KIND,D,C",
        help="one constant loop of the grid instead of --shape: KIND sleep, numpy or python, "
        "D and C us a batch, with --workers workers",
    )
    parser.add_argument(
        "--workers",
        type=worker_count,
        default=0,
        metavar="N",
        help="DataLoader workers of the shaped numpy loops and of --cell (default 0)",
    )
    parser.add_argument("--before", metavar="PATH", help="a copy of prefetchx/_adapt.py")
    parser.add_argument(
        "--no-thread",
        action="store_true",
        help="leave the thread arm out (its epochs between the others change how often a "
        "chooser keeps the loop alone)",
    )
    parser.add_argument("--recipe", action="store_true", help="add the recipe's arm")
    parser.add_argument("--quick", action="store_true", help="2 runs of 3 short epochs (tests)")
    parser.add_argument("--out", metavar="STEM", help="write STEM.txt and STEM.json")
    args = parser.parse_args(argv)
    if not args.epoch_ms > 0:
        parser.error(f"--epoch-ms must be above 0, got {args.epoch_ms}")
    if args.workers and args.shape in THREAD_SLOWER and args.cell is None:
        parser.error(f"--workers is for the shaped numpy loops, not --shape {args.shape}")
    if args.cell is not None and args.no_thread:
        parser.error("--cell reads the loop's slower mode from the thread arm: drop --no-thread")
    runs, epochs, epoch_ms = (2, 3, 20.0) if args.quick else (args.runs, args.epochs, args.epoch_ms)
    try:
        before = load_chooser(args.before) if args.before else None
    except ValueError as exc:
        parser.error(f"--before: {exc}")
    if args.cell is None:
        cell, shape = the_loop(args.shape, epoch_ms, args.workers), args.shape
    else:
        kind, data_us, step_us = args.cell
        one = grid.Cell(kind, args.workers, data_us / 1e3, step_us / 1e3)
        cell, shape = sized(one, epoch_ms), CELL
    meta = {**machine_meta(), "runs": runs, "epochs": epochs, "epoch_ms": epoch_ms}
    meta |= {"shape": shape, "before": args.before, "thread": not args.no_thread}
    meta["recipe"] = args.recipe
    meta["quick"] = args.quick
    done = []
    for n in range(runs):
        done.append(
            one_run(cell, epochs, before, thread=not args.no_thread, start=n, recipe=args.recipe)
        )
        print(f"run {n + 1}/{runs}", file=sys.stderr, flush=True)
    figures = summarize(done)
    conclusion = conclude(figures, args.quick, shape)
    text = render(meta, cell, figures, conclusion)
    print(text, end="")
    if args.out:
        Path(f"{args.out}.txt").write_text(text)
        record = {"meta": meta, "cell": cell.label, "arms": ARMS, "figures": figures}
        record |= {"runs": done, "conclusion": conclusion}
        Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
