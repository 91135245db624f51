"""Issue #64's new-loader targets: what a loader costs from its first batch, as users meet it.

Every new loader starts cold: a new process, an evaluation loader built anew at each
``evaluate()``, a reloaded loader, a short fine-tune, the first demo a user runs. Here every arm
is a new loader in every round, timed from before it is made: its construction, its ``iter()``
and every batch, with the step called once per batch. Four arms run interleaved in one process,
in paired rounds whose order changes from round to round (`prefetchx.bench.paired`):

* ``plain``: ``torch.utils.data.DataLoader``;
* ``again``: a second plain DataLoader, plain against itself: every difference it shows is the
  machine's noise, and each target is read with it;
* ``recipe``: the 5-line ``BackgroundGenerator`` recipe over DataLoader;
* ``prefetchx``: ``DataLoaderX(..., device="cpu")``.

The cells and their targets (issue #64), all without workers:

* ``seed demo, 20 items`` and ``seed demo, 200 items``: the recipe's own demo, a dataset whose
  items each sleep 50 ms, batch 4, a 100 ms sleeping "training step": DataLoaderX at least
  0.97x the recipe's speed. The 200-item cell takes 10-15 s an arm a round.
* ``sleep 5/5 ms, 120 batches``: 5 ms of sleeping data and a 5 ms sleeping step a batch: overlap
  at least 0.97, where overlap is the bound over the arm's time, the bound being the shortest
  epoch any prefetcher could make of the round's work (`prefetchx.bench.synthetic.bound`, from
  the plain arm's own data and step times in the round: about the sum of max(data, step) over
  the batches, plus the first batch's data). And the first 10 batches of the same new loaders
  (the time to the end of the 10th step): DataLoaderX's time per batch within 10% of the
  recipe's, its speed at least 1/1.1 = 0.909x the recipe's.
* ``no work, 4000 batches``: a ``TensorDataset``, batch 4, no step: at least 0.95x plain.
* ``python 0.2/0.2 ms, 2000 batches``: pure-Python data and step of 200 us each (calibrated
  `prefetchx.bench.synthetic.Work`), which hold the GIL: at least 0.95x plain.

Each figure is taken within the round (one arm's time over another's, or the bound over an
arm's time) and reported as the median over rounds with the lowest and highest round. A target
is met, not met, or too noisy to tell (`prefetchx.bench.paired.judge`): too noisy when the
target lies within two standard errors of the median, estimated from the figure's own rounds
and from plain against itself in the same rounds. The run ends with one sentence that counts the
verdicts (`conclude`), and says when the machine was too busy to decide.

Usage (the record: on a quiet machine, about 9 minutes at 7 rounds, 6 of them the 200-item
demo; name the file for the machine):
    python benchmarks/new_loader.py \
        --out benchmarks/results/new_loader-cpu-2core-$(git rev-parse --short HEAD)
    python benchmarks/new_loader.py --only 'seed demo, 200' --rounds 5 --out STEM  # one cell
    python benchmarks/new_loader.py --quick  # seconds: costs and sizes scaled down, a smoke run

``--out STEM`` writes ``STEM.txt`` (what it prints, under a line naming the machine, the
versions and the commit) and ``STEM.json`` (the same with every round's times). Only the public
API is used (``DataLoaderX``), so the program measures whichever thread stage the tree holds.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from prefetchx.bench.paired import (
    Spread,
    judge,
    run_rounds,
    too_busy,
    uncertainty,
)
from prefetchx.bench.record import depth, meta_line, out_stem, report, rounds
from prefetchx.bench.synthetic import (
    ARMS,
    Work,
    WorkDataset,
    bound,
    explain,
    machine_meta,
    overlaps,
    release,
)

ARM_ORDER = ("plain", "again", "recipe", "prefetchx")
DEFAULT_ROUNDS = 7
"""Paired rounds a cell runs by default: more than the 5 a figure needs at least, so that one
odd round moves a median less."""
FIRST = 10
"""The batches a new loader's start is timed over (issue #64's trace was per 10 batches)."""
OURS = "prefetchx"

FIGURES = {
    "vs plain": "the arm's speed over the plain DataLoader's, within each round (plain's time "
    "over the arm's): the median and, in brackets, the lowest and highest round; above 1.00x is "
    "faster",
    "vs recipe": "the same over the recipe's",
    "overlap": "the bound over the arm's time, within each round: 1.000 is a perfect prefetcher. "
    "The bound is the shortest epoch any prefetcher could make of the round's work, from the "
    "plain arm's own data and step times: max over k of data[0..k] + step[k..n-1] where the two "
    "can overlap (sleep), their sum where they cannot (pure Python)",
    "first 10 vs recipe": f"over the first {FIRST} batches of the same new loaders (from before "
    f"the loader is made to the end of the {FIRST}th step), the recipe's time over the arm's",
}
"""What each figure a target reads is."""

COLUMNS = {
    "epoch ms": "the arm's median time for the whole epoch of a new loader: its construction, "
    "its iter() and every batch with its step",
    "vs plain": FIGURES["vs plain"],
    "vs recipe": FIGURES["vs recipe"],
    "overlap": FIGURES["overlap"] + "; the median (lowest-highest)",
    f"first {FIRST} ms": f"the arm's median time per batch over its first {FIRST} batches, "
    "construction included",
    "target": "the figure the target reads, for DataLoaderX: median (lowest-highest round), "
    "+/- its uncertainty (two standard errors of the median, from its rounds and from plain "
    "against itself), and the verdict: met where the median clears the target by the "
    "uncertainty, not met where it misses by more, too noisy to tell in between",
}


@dataclass(frozen=True)
class Target:
    """A target for DataLoaderX in one cell: ``figure >= line``, as ``says`` puts it."""

    figure: str
    line: float
    says: str


@dataclass(frozen=True)
class Cell:
    """A loop of new loaders: ``items`` items each costing ``data_ms`` of ``kind`` work, in
    batches of ``batch_size`` (``None``: each item a batch), a step of ``step_ms`` a batch."""

    label: str
    kind: str
    items: int
    batch_size: int | None
    data_ms: float
    step_ms: float
    targets: tuple[Target, ...]

    @property
    def batches(self) -> int:
        """Batches an epoch."""
        return self.items if self.batch_size is None else math.ceil(self.items / self.batch_size)

    def describe(self) -> str:
        """The cell's line above its table: its work, its sizes."""
        if self.kind == "none":
            work = "no work: a TensorDataset and no step"
        else:
            work = (
                f"{self.kind}: {self.data_ms:g} ms of data an item and a {self.step_ms:g} ms step "
                "a batch"
            )
        batch = "each item a batch" if self.batch_size is None else f"batch {self.batch_size}"
        return f"{work}; {self.items} items, {batch}, {self.batches} batches, no workers"


DEMO = Target("vs recipe", 0.97, "DataLoaderX >= 0.97x the recipe's speed")
OVERLAP = Target("overlap", 0.97, "DataLoaderX's overlap >= 0.97")
START = Target(
    "first 10 vs recipe",
    1 / 1.1,
    f"DataLoaderX's time per batch over its first {FIRST} within 10% of the recipe's "
    "(its speed >= 1/1.1 = 0.909x the recipe's)",
)
PLAIN = Target("vs plain", 0.95, "DataLoaderX >= 0.95x plain's speed")


def cells(quick: bool) -> list[Cell]:
    """Issue #64's cells; with ``quick``, the same loops with costs and sizes scaled down to a
    run of seconds (a smoke run: nothing to quote)."""
    if quick:
        return [
            Cell("seed demo, 8 items", "sleep", 8, 4, 2.0, 4.0, (DEMO,)),
            Cell("seed demo, 40 items", "sleep", 40, 4, 2.0, 4.0, (DEMO,)),
            Cell("sleep 1/1 ms, 20 batches", "sleep", 20, None, 1.0, 1.0, (OVERLAP, START)),
            Cell("no work, 400 batches", "none", 1600, 4, 0.0, 0.0, (PLAIN,)),
            Cell("python 0.05/0.05 ms, 200 batches", "python", 200, None, 0.05, 0.05, (PLAIN,)),
        ]
    return [
        Cell("seed demo, 20 items", "sleep", 20, 4, 50.0, 100.0, (DEMO,)),
        Cell("seed demo, 200 items", "sleep", 200, 4, 50.0, 100.0, (DEMO,)),
        Cell("sleep 5/5 ms, 120 batches", "sleep", 120, None, 5.0, 5.0, (OVERLAP, START)),
        Cell("no work, 4000 batches", "none", 16000, 4, 0.0, 0.0, (PLAIN,)),
        Cell("python 0.2/0.2 ms, 2000 batches", "python", 2000, None, 0.2, 0.2, (PLAIN,)),
    ]


# --- one cell ------------------------------------------------------------------------------------


def timed(
    make: Callable[[], Iterable[Any]], step: Callable[[], None], first: int = FIRST
) -> tuple[float, float | None]:
    """One epoch of a new loader: seconds from before ``make`` builds it to its last batch's
    step, and to its ``first``-th batch's (``None`` in a shorter epoch). Released after."""
    start = time.perf_counter()
    loader = make()
    reached = None
    try:
        for count, _ in enumerate(loader, 1):
            step()
            if count == first:
                reached = time.perf_counter() - start
        return time.perf_counter() - start, reached
    finally:
        release(loader)  # untimed: an epoch run to its end leaves nothing to stop


def _dataset(cell: Cell) -> tuple[Dataset[Any], Work | None]:
    """The cell's dataset, and the work its items call (``None`` for no work)."""
    if cell.kind == "none":
        return TensorDataset(torch.zeros(cell.items, 1)), None
    data = Work(cell.kind, cell.data_ms)
    return WorkDataset(cell.items, data), data


def _per_batch(calls: Sequence[float], batch_size: int | None) -> list[float]:
    """Item calls summed into batches."""
    size = batch_size or 1
    return [sum(calls[i : i + size]) for i in range(0, len(calls), size)]


def measure(
    cell: Cell,
    rounds: int,
    max_prefetch: int = 2,
    arms: Sequence[str] = ARM_ORDER,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``arms`` over ``cell`` in ``rounds`` paired rounds, each a new loader every round.

    Returns:
        The cell's record: ``epochs_s`` and ``first_s`` (each arm's times, round by round),
        ``bounds_s`` (each round's bound, none for no work), ``figures`` (each arm's per-round
        figures as spreads) and ``targets`` (each target's figure, noise and verdict).
    """
    dataset, data = _dataset(cell)
    step = Work("sleep" if cell.kind == "none" else cell.kind, cell.step_ms)
    kwargs = {"batch_size": cell.batch_size}
    firsts: dict[str, list[float | None]] = {name: [] for name in arms}
    bounds: list[float] = []

    def arm(name: str) -> Callable[[], float]:
        def run() -> float:
            if data is not None:
                data.calls.clear()
            step.calls.clear()
            seconds, first = timed(lambda: ARMS[name](dataset, max_prefetch, kwargs), step)
            firsts[name].append(first)
            if name == "plain" and data is not None:
                # Measured where nothing ran beside the work: no waits for the GIL or a core.
                made = _per_batch(data.calls, cell.batch_size)
                bounds.append(bound(made, step.calls, overlaps(cell.kind)))
            return seconds

        return run

    def report_round(done: int) -> None:
        if progress is not None:
            progress(f"  {cell.label}: round {done}/{rounds}")

    times = run_rounds({name: arm(name) for name in arms}, rounds, report_round)
    return read(cell, times, firsts, bounds)


def read(
    cell: Cell,
    times: Mapping[str, Sequence[float]],
    firsts: Mapping[str, Sequence[float | None]],
    bounds: Sequence[float],
) -> dict[str, Any]:
    """A cell's figures and verdicts from its rounds' times (see `measure`)."""
    figures = {name: per_round(name, times, firsts, bounds) for name in times}
    noise = per_round("again", times, firsts, bounds, over="plain") if "again" in times else {}
    targets = []
    for target in cell.targets:
        value = figures[OURS][target.figure]
        twin = noise.get("first 10" if target.figure.startswith("first") else "vs plain")
        targets.append(
            {
                **asdict(target),
                "value": asdict(value),
                "noise": asdict(twin) if twin is not None else None,
                "uncertainty": uncertainty(value, twin),
                "verdict": judge(value, target.line, twin),
                "machine_too_busy": twin is not None and too_busy(twin),
            }
        )
    return {
        **asdict(cell),
        "label": cell.label,
        "batches": cell.batches,
        "rounds": len(times["plain"]),
        "epochs_s": {name: list(t) for name, t in times.items()},
        "first_s": {name: list(f) for name, f in firsts.items()},
        "bounds_s": list(bounds),
        "figures": {
            name: {figure: asdict(spread) for figure, spread in arm.items()}
            for name, arm in figures.items()
        },
        "targets": targets,
    }


def per_round(
    name: str,
    times: Mapping[str, Sequence[float]],
    firsts: Mapping[str, Sequence[float | None]],
    bounds: Sequence[float],
    over: str | None = None,
) -> dict[str, Spread]:
    """``name``'s figures, each taken within the round, as spreads over the rounds.

    ``vs plain`` and ``vs recipe`` are the other arm's time over this one's; ``overlap`` the
    bound over this arm's time; ``first 10 vs recipe`` the recipe's time to its 10th batch over
    this arm's. With ``over``, ``first 10`` is ``over``'s time to its 10th batch over this
    arm's: plain against itself's noise for that figure.
    """
    mine = times[name]
    out: dict[str, Spread] = {}
    for other in ("plain", "recipe"):
        if other in times:
            out[f"vs {other}"] = Spread.of([o / m for o, m in zip(times[other], mine, strict=True)])
    if bounds:
        out["overlap"] = Spread.of([b / m for b, m in zip(bounds, mine, strict=True)])
    for other, figure in ((over, "first 10"), ("recipe", "first 10 vs recipe")):
        if other is None or other not in firsts:
            continue
        pairs = list(zip(firsts[other], firsts[name], strict=True))
        if all(o is not None and m is not None for o, m in pairs):
            out[figure] = Spread.of([o / m for o, m in pairs])  # type: ignore[operator]
    return out


# --- what it says --------------------------------------------------------------------------------


def _spread_text(spread: Mapping[str, Any], spec: str = ".2f", suffix: str = "x") -> str:
    return f"{spread['median']:{spec}}{suffix} ({spread['low']:{spec}}-{spread['high']:{spec}})"


def format_cell(cell: Mapping[str, Any]) -> str:
    """A cell's block: its line, one row an arm, one line a target."""
    lines = [
        f"{cell['label']}: {_cell(cell).describe()}; {cell['rounds']} rounds",
        f"  {'arm':<10} {'epoch ms':>9}  {'vs plain':<19} {'vs recipe':<19} "
        f"{'overlap':<21} {f'first {FIRST} ms':>11}",
    ]
    for name, times in cell["epochs_s"].items():
        figures = cell["figures"][name]
        firsts = [f for f in cell["first_s"][name] if f is not None]
        first = f"{statistics.median(firsts) / FIRST * 1e3:.2f}" if firsts else "-"
        lines.append(
            f"  {name:<10} {statistics.median(times) * 1e3:>9.1f}  "
            f"{_or_dash(figures.get('vs plain'), 19)} {_or_dash(figures.get('vs recipe'), 19)} "
            f"{_or_dash(figures.get('overlap'), 21, '.3f', '')} {first:>11}"
        )
    for target in cell["targets"]:
        lines.append(f"  target: {target['says']}")
        lines.append(f"    {target_line(target)}")
    return "\n".join(lines)


def _cell(cell: Mapping[str, Any]) -> Cell:
    fields = {k: cell[k] for k in ("label", "kind", "items", "batch_size", "data_ms", "step_ms")}
    return Cell(**fields, targets=())


def _or_dash(
    spread: Mapping[str, Any] | None, width: int, spec: str = ".2f", suffix: str = "x"
) -> str:
    return f"{'-' if spread is None else _spread_text(spread, spec, suffix):<{width}}"


def target_line(target: Mapping[str, Any]) -> str:
    """A target's reading: its figure, its uncertainty, plain against itself, the verdict."""
    noise = target["noise"]
    against = "" if noise is None else f", plain against itself {_spread_text(noise, '.3f', '')}"
    return (
        f"{target['figure']} {_spread_text(target['value'], '.3f', '')} +/- "
        f"{target['uncertainty']:.3f}{against}, target {target['line']:.3f}: "
        f"{target['verdict']}"
    )


def conclude(results: Sequence[Mapping[str, Any]], quick: bool) -> str:
    """One sentence: how many targets the run met, missed and could not tell, naming the ones
    missed and untold, and whether the machine was too busy for those it could not tell."""
    read = [(cell["label"], t) for cell in results for t in cell["targets"]]
    if not read:
        return "Nothing was measured."
    where = "On this machine (a --quick run: nothing to quote)" if quick else "On this machine"

    def named(verdict: str) -> list[str]:
        return [
            f"{label}, {t['figure']} {t['value']['median']:.3f} against {t['line']:.3f}"
            for label, t in read
            if t["verdict"] == verdict
        ]

    met, missed, untold = named("met"), named("not met"), named("too noisy to tell")
    text = (
        f"{where}, new DataLoaderX loaders, timed from their first batch, met {len(met)} of "
        f"{len(read)} targets"
    )
    if missed:
        text += f", missed {len(missed)} ({'; '.join(missed)})"
    if untold:
        were = "was" if len(untold) == 1 else "were"
        text += f", and {len(untold)} {were} too noisy to tell ({'; '.join(untold)})"
    busy = [t for _, t in read if t["verdict"] == "too noisy to tell" and t["machine_too_busy"]]
    if busy:
        text += (
            f": the machine was too busy for {len(busy)} of them (plain against itself alone "
            "left a median more than 2% of noise): run them again on a quiet machine"
        )
    return text + "."


# --- the program ---------------------------------------------------------------------------------


def _pattern(value: str) -> re.Pattern[str]:
    try:
        return re.compile(value)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {exc}") from None


def parser() -> argparse.ArgumentParser:
    """The program's options."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rounds",
        type=rounds,
        default=DEFAULT_ROUNDS,
        metavar="N",
        help=f"paired rounds a cell, >= 5 (default {DEFAULT_ROUNDS}; --quick: 5)",
    )
    p.add_argument(
        "--max-prefetch",
        type=depth,
        default=2,
        metavar="N",
        help="queue depth of DataLoaderX and of the recipe, >= 1 (default 2, DataLoaderX's own)",
    )
    p.add_argument(
        "--only", type=_pattern, metavar="REGEX", help="run the cells whose label matches"
    )
    p.add_argument("--quick", action="store_true", help="costs and sizes scaled down: seconds")
    p.add_argument("--out", type=out_stem, metavar="STEM", help="write STEM.txt and STEM.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the cells, print the tables and the conclusion, and with ``--out`` record them."""
    args = parser().parse_args(argv)
    chosen = cells(args.quick)
    if args.only is not None:
        chosen = [cell for cell in chosen if args.only.search(cell.label)]
        if not chosen:
            parser().error(f"--only matches no cell's label: {args.only.pattern!r}")
    count = 5 if args.quick else args.rounds
    meta = {
        **machine_meta(),
        "rounds": count,
        "max_prefetch": args.max_prefetch,
        "quick": args.quick,
        "only": None if args.only is None else args.only.pattern,
    }
    print(meta_line(meta), file=sys.stderr, flush=True)
    started = time.perf_counter()
    results = []
    for i, cell in enumerate(chosen):
        print(f"cell {i + 1}/{len(chosen)}: {cell.label}", file=sys.stderr, flush=True)
        results.append(measure(cell, count, args.max_prefetch, progress=_log))
    conclusion = conclude(results, args.quick)
    head = (
        f"New loaders (issue #64): {len(results)} cells, {count} paired rounds each, arms "
        "interleaved in one process, each arm a new loader every round timed from before it is "
        f"made; {time.perf_counter() - started:.0f} s in all"
    )
    report(
        args.out,
        meta,
        [head, *map(format_cell, results), explain(COLUMNS, ARM_ORDER)],
        conclusion,
        COLUMNS,
        ARM_ORDER,
        cells=results,
        figures=FIGURES,
    )
    return 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
