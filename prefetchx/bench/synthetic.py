"""A synthetic training loop that measures what the thread stage saves.

Each batch costs the producer ``data_ms`` and the training step ``step_ms`` of one kind of work:

* ``sleep``: `time.sleep`, which releases the GIL (I/O waits behave alike);
* ``numpy``: numpy ufuncs over an array, single-threaded and releasing the GIL;
* ``python``: a pure-Python loop, which holds the GIL: the control, where no thread can help.

Arms run in paired rounds (`prefetchx.bench.paired`): each round runs every arm once, back to
back, and each arm's speed is taken against the plain ``DataLoader``'s within the round. Each arm
is a new loader in every round, timed from before it is made (construction, ``iter()`` and
every batch), as a user meets it: a new process, an evaluation loader built anew, a short
fine-tune. Only the ``warmed`` arm is one loader kept over the rounds, after `WARM_BATCHES`
untimed batches: the steady state a long run reaches, labelled as such. A
prefetching arm is also held against the *bound*, the shortest epoch any prefetcher could make of
the round's work (`bound`), from the data and step times of the plain arm in the same round:
there nothing runs beside the work, so its times hold no waits for the GIL or for a core.
"""

from __future__ import annotations

import math
import os
import platform
import queue
import statistics
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from prefetch_generator import BackgroundGenerator
from torch.utils.data import DataLoader, Dataset

from prefetchx import __version__
from prefetchx._loader import DataLoaderX
from prefetchx.bench.paired import (
    CLEAR,
    MIN_ROUNDS,
    Spread,
    compare,
    ratios,
    run_rounds,
    too_busy,
    uncertainty,
)

KINDS = ("sleep", "numpy", "python")

UNITS = {"numpy": (1_000, 10_000, 100_000), "python": (20, 100, 500)}
"""Sizes of one unit of work (array elements, loop iterations), smallest first; each `Work`
takes the largest whose unit is at most half its cost, so short costs stay accurate."""


class Work:
    """A calibrated amount of one kind of work, about ``ms`` milliseconds, that times each call.

    ``calls`` holds the duration of each call since it was last cleared (in the process that
    made the call: a DataLoader worker keeps its own).
    """

    def __init__(self, kind: str, ms: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")
        self.kind = kind
        self.ms = ms
        self.calls: list[float] = []
        self.reps = 0
        self.size = 0
        self._x = np.empty(0)
        self._out = np.empty(0)
        if ms > 0 and kind != "sleep":
            for size in reversed(UNITS[kind]):
                self._resize(size)
                unit = min(self._time_unit() for _ in range(3))
                if unit <= ms / 2e3:
                    break
            self.reps = max(1, round(ms / 1e3 / unit))

    def _resize(self, size: int) -> None:
        self.size = size
        self._x = np.linspace(0.0, 1.0, size)
        self._out = np.empty_like(self._x)

    def _unit(self) -> None:
        if self.kind == "numpy":
            np.sin(self._x, out=self._out)
        else:
            sum(i * i for i in range(self.size))

    def _time_unit(self) -> float:
        start = time.perf_counter()
        for _ in range(10):
            self._unit()
        return (time.perf_counter() - start) / 10

    @property
    def spent(self) -> float:
        """Seconds the calls since the last ``calls.clear()`` took."""
        return sum(self.calls)

    def __call__(self) -> None:
        if self.ms <= 0:
            return
        start = time.perf_counter()
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
        else:
            for _ in range(self.reps):
                self._unit()
        self.calls.append(time.perf_counter() - start)


class WorkDataset(Dataset[torch.Tensor]):
    """``n`` small items, each costing one call of ``work`` to produce."""

    def __init__(self, n: int, work: Callable[[], None]) -> None:
        self.n = n
        self.work = work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.work()
        return torch.full((4,), i)


class RecipeLoader(DataLoader[Any]):
    """The widely copied recipe: `BackgroundGenerator` over the DataLoader iterator."""

    def __init__(self, *args: Any, max_prefetch: int = 2, **kwargs: Any) -> None:
        self.max_prefetch = max_prefetch
        super().__init__(*args, **kwargs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not DataLoader's
        return BackgroundGenerator(super().__iter__(), max_prefetch=self.max_prefetch)  # type: ignore[no-any-return]


WARM_BATCHES = 128
"""Batches the ``warmed`` arm runs untimed before the rounds, in whole epochs, one at least: the
other arms are new loaders timed from their first batch, as users meet them (issue #64: 128
untimed batches hid a new loader's first 40-60 batches without its thread). The warmed arm
stands beside them to show the steady state a long run reaches, not what a new loader pays."""

_END = object()


class RunAhead:
    """The floor of a threaded hand-off: a thread runs the loader's whole epoch ahead into an
    unbounded `queue.SimpleQueue`, the cheapest hand-off Python has (no bound, no stop signal,
    no lifecycle), so the consumer rarely waits for a wake-up. For full epochs only: leaving one
    early waits for the thread to finish it.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.loader)  # on the calling thread, where DataLoader starts its workers
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def run() -> None:
            try:
                for item in source:
                    items.put(item)
            except BaseException as exc:  # handed to the consumer, raised there
                items.put(exc)
            items.put(_END)

        thread = threading.Thread(target=run, name="bench-run-ahead", daemon=True)
        thread.start()
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            thread.join()


def release(loader: Iterable[Any]) -> None:
    """Shut an arm's persistent workers down now, as the end of a measurement should."""
    close = getattr(loader, "close", None)
    if close is not None:  # DataLoaderX
        close()
    elif isinstance(loader, RunAhead):
        release(loader.loader)
    elif isinstance(loader, DataLoader) and loader._iterator is not None:
        # DataLoader has no public call for it: its kept iterator shuts them down.
        iterator, loader._iterator = loader._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


ArmFactory = Callable[[Dataset[Any], int, dict[str, Any]], Iterable[Any]]

ARMS: dict[str, ArmFactory] = {
    "plain": lambda dataset, depth, kw: DataLoader(dataset, **kw),
    "recipe": lambda dataset, depth, kw: RecipeLoader(dataset, max_prefetch=depth, **kw),
    # device="cpu": these arms compare loops on the CPU. With device=None, a machine with a GPU
    # would give DataLoaderX's batches to it and time a copy the other arms never make.
    "prefetchx": lambda dataset, depth, kw: DataLoaderX(
        dataset, max_prefetch=depth, device="cpu", **kw
    ),
    "inline": lambda dataset, depth, kw: DataLoaderX(dataset, max_prefetch=0, device="cpu", **kw),
    "warmed": lambda dataset, depth, kw: DataLoaderX(
        dataset, max_prefetch=depth, device="cpu", **kw
    ),
    "floor": lambda dataset, depth, kw: RunAhead(DataLoader(dataset, **kw)),
    "again": lambda dataset, depth, kw: DataLoader(dataset, **kw),
    "recipe again": lambda dataset, depth, kw: RecipeLoader(dataset, max_prefetch=depth, **kw),
}
"""How each arm builds its loader from the dataset, the queue depth and DataLoader's arguments."""

ARM_NOTES = {
    "plain": "torch's DataLoader, the baseline",
    "recipe": "the BackgroundGenerator recipe: a Queue(max_prefetch) thread over DataLoader",
    "prefetchx": "DataLoaderX(max_prefetch=N, device='cpu'), the thread stage with its inline "
    "switch",
    "warmed": f"DataLoaderX as the prefetchx arm, but one loader kept over the rounds after "
    f"{WARM_BATCHES} untimed batches: the steady state of a long run, not what a new loader pays",
    "inline": "DataLoaderX(max_prefetch=0, device='cpu'): no thread, DataLoaderX's own bookkeeping "
    "only",
    "floor": "a thread running DataLoader a whole epoch ahead into a queue.SimpleQueue: the "
    "cheapest threaded hand-off, the floor for the threaded arms",
    "again": "a second plain DataLoader, made as the first: plain against itself, so how far its "
    "median strays from 1.00x is the measurement's noise, not a difference",
    "recipe again": "a second recipe, made as the first: where the recipe wins, how far this "
    "one falls below the first recipe, round by round, is the noise of holding an arm to the "
    "recipe there, not a difference",
}
"""What each arm is, as the outputs explain it."""

PREFETCHING = ("recipe", "prefetchx", "warmed", "floor")
"""Arms that run the loader ahead in a thread: the bound means something for them only (plain
and inline make each batch when asked, so their best is themselves)."""


def overlaps(kind: str, cpus: int | None = None) -> bool:
    """Whether data work and step work of ``kind`` can run at the same time in one process.

    Sleeps always can; numpy work can with two cores or more; pure Python never can (the GIL).
    """
    if kind == "python":
        return False
    if kind == "numpy":
        return (cpus if cpus is not None else _usable_cpus()) >= 2
    return True


def _usable_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def bound(data: Sequence[float], step: Sequence[float], overlap: bool = True) -> float:
    """The shortest epoch any prefetcher could make of this work, in seconds.

    Batch ``i`` costs ``data[i]`` to make and ``step[i]`` to train on (a side with no work may
    be empty). Where the two cannot overlap (`overlaps`), the bound is their sum. Where they
    can, it is the two-stage pipeline's: step ``k`` starts after the data of batches ``0..k``
    (made one after the other) and the steps from ``k`` on follow it, so the epoch takes at
    least ``max over k of sum(data[:k + 1]) + sum(step[k:])``. With equal batches that is
    ``max(data[0] + sum(step), sum(data) + step[-1])``: the first data and every step when the
    step dominates, all the data and the last step when the data does.

    Examples:
        >>> round(bound([0.010] * 30, [0.005] * 30), 9)  # data dominates: 30 x 10 ms, a step
        0.305
        >>> round(bound([0.005] * 30, [0.010] * 30), 9)  # the step dominates: first data, 30 steps
        0.305
        >>> round(bound([0.005] * 30, [0.005] * 30, overlap=False), 9)  # one at a time: the sum
        0.3
    """
    n = max(len(data), len(step))
    d = list(data) + [0.0] * (n - len(data))
    c = list(step) + [0.0] * (n - len(step))
    if not overlap:
        return sum(d) + sum(c)
    best = made = 0.0
    rest = sum(c)
    for k in range(n):
        made += d[k]
        best = max(best, made + rest)
        rest -= c[k]
    return best


@dataclass
class Case:
    """One point of the grid: kind of work, per-batch data and step cost in ms, batches, rounds.

    ``note`` says what sets the case apart from another with the same costs.
    """

    kind: str
    data_ms: float
    step_ms: float
    batches: int
    rounds: int = MIN_ROUNDS
    arms: tuple[str, ...] = ("plain", "again", "recipe", "prefetchx", "warmed")
    note: str = ""

    @property
    def label(self) -> str:
        """A short name, as the conclusion and the plot give it."""
        if self.data_ms <= 0 and self.step_ms <= 0:
            return f"no work, {self.batches} batches"
        return f"{self.kind} {self.data_ms:g}/{self.step_ms:g} ms"


@dataclass
class ArmResult:
    """One arm's figures for one case.

    ``speedup`` is the median over rounds of the plain arm's epoch time over this arm's in the
    same round (above 1: faster than plain), ``speedup_low``/``speedup_high`` the lowest and
    highest round. ``bound_s`` is the median bound (`bound`), ``overlap_efficiency`` the median
    of bound over epoch time (1.0 is a perfect prefetcher) and ``per_batch_us`` the median of
    the epoch time above the bound per batch; these three are ``None`` for an arm that does not
    prefetch and for a case with no work. ``data_call_ms`` and ``step_call_ms``: the median
    time one call of the work took in the plain arm (a sleep overshoots), ``None`` for no work.
    """

    case: Case
    arm: str
    epoch_s: float
    epochs_s: list[float]
    speedup: float
    speedup_low: float
    speedup_high: float
    speedups: list[float]
    bound_s: float | None = None
    overlap_efficiency: float | None = None
    per_batch_us: float | None = None
    data_call_ms: float | None = None
    step_call_ms: float | None = None
    bounds_s: list[float] = field(default_factory=list)

    @property
    def spread(self) -> Spread:
        """The per-round speedups as a `Spread`."""
        return Spread(self.speedup, self.speedup_low, self.speedup_high, self.speedups)


def run_epoch(loader: Iterable[Any], step: Callable[[], None]) -> float:
    """Time one epoch of ``loader`` with ``step`` called once per batch."""
    start = time.perf_counter()
    for _ in loader:
        step()
    return time.perf_counter() - start


def run_new(make: Callable[[], Iterable[Any]], step: Callable[[], None]) -> float:
    """Time one epoch of a new loader from before ``make`` builds it: its construction, its
    ``iter()`` and every batch, with ``step`` called once per batch; release it after."""
    start = time.perf_counter()
    loader = make()
    try:
        for _ in loader:
            step()
        return time.perf_counter() - start
    finally:
        release(loader)  # untimed: a loop that ends its epoch has nothing left to stop


def _median_call_ms(calls: list[list[float]]) -> float | None:
    means = [sum(c) / len(c) for c in calls if c]
    return statistics.median(means) * 1e3 if means else None


def measure(
    case: Case, max_prefetch: int = 2, progress: Callable[[str], None] | None = None
) -> list[ArmResult]:
    """Run every arm of ``case`` in ``case.rounds`` paired rounds (see `prefetchx.bench.paired`).

    Each arm but ``warmed`` is a new loader in every round, timed from its first batch
    (`run_new`); ``warmed`` is one loader, run `WARM_BATCHES` untimed batches first.
    """
    if "plain" not in case.arms:
        raise ValueError(f"`case.arms` must include 'plain', the baseline, got {case.arms}.")
    data, step = Work(case.kind, case.data_ms), Work(case.kind, case.step_ms)
    dataset = WorkDataset(case.batches, data)

    def make(name: str) -> Iterable[Any]:
        return ARMS[name](dataset, max_prefetch, {"batch_size": None})

    warmed = {name: make(name) for name in case.arms if name == "warmed"}
    for loader in warmed.values():
        for _ in range(max(1, math.ceil(WARM_BATCHES / max(1, case.batches)))):
            run_epoch(loader, step)
    data_calls: list[list[float]] = []  # the plain arm's, per round
    step_calls: list[list[float]] = []

    def arm(name: str) -> Callable[[], float]:
        def run() -> float:
            data.calls.clear()
            step.calls.clear()
            if name in warmed:
                seconds = run_epoch(warmed[name], step)
            else:
                seconds = run_new(lambda: make(name), step)
            if name == "plain":
                data_calls.append(data.calls[:])
                step_calls.append(step.calls[:])
            return seconds

        return run

    def report(done: int) -> None:
        if progress is not None:
            progress(f"  {case.label}: round {done}/{case.rounds}")

    try:
        times = run_rounds({name: arm(name) for name in case.arms}, case.rounds, report)
    finally:
        for loader in warmed.values():
            release(loader)
    speedups = ratios(times)
    no_work = case.data_ms <= 0 and case.step_ms <= 0
    together = overlaps(case.kind)
    bounds = [bound(d, c, together) for d, c in zip(data_calls, step_calls, strict=True)]
    results = []
    for name in case.arms:
        epochs, spread = times[name], speedups[name]
        result = ArmResult(
            case=case,
            arm=name,
            epoch_s=statistics.median(epochs),
            epochs_s=epochs,
            speedup=spread.median,
            speedup_low=spread.low,
            speedup_high=spread.high,
            speedups=spread.rounds,
            data_call_ms=_median_call_ms(data_calls),
            step_call_ms=_median_call_ms(step_calls),
        )
        if name in PREFETCHING and not no_work:
            pairs = list(zip(bounds, epochs, strict=True))
            result.bounds_s = bounds
            result.bound_s = statistics.median(bounds)
            result.overlap_efficiency = statistics.median(b / e for b, e in pairs)
            result.per_batch_us = statistics.median((e - b) / case.batches * 1e6 for b, e in pairs)
        results.append(result)
    return results


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # an installed copy, not a checkout


def machine_meta() -> dict[str, Any]:
    """Where and with what a benchmark ran: versions, machine, CPUs, GPU, git commit."""
    # Whoever copied the tree may say which commit it is, and is believed first: a copy's .git
    # can name an older commit than its files (the device tool's did).
    commit = os.environ.get("PREFETCHX_COMMIT") or _git_commit()
    meta: dict[str, Any] = {
        "prefetchx": __version__,
        "commit": commit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
    return meta


def as_rows(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Results as plain dicts, for JSON."""
    return [asdict(r) for r in results]


VS_PLAIN = (
    "the arm's throughput over the plain DataLoader's, taken within each round (plain's epoch "
    "time over the arm's, run back to back): the median and, in brackets, the lowest and "
    "highest round; above 1.00x is faster"
)
"""What a ratio over plain in a table is, as its legend says."""

COLUMNS = {
    "epoch ms": "the arm's median epoch time",
    "vs plain": VS_PLAIN,
    "bound ms": "the shortest epoch any prefetcher could make of the round's work: from the data "
    "and step times the plain arm measured in the same round, with nothing beside them (no waits "
    "for the GIL or a core), max over k of data[0..k] + step[k..n-1] where the two can overlap "
    "(sleep; numpy on 2 cores or more), their sum where they cannot (pure Python)",
    "overlap": "bound ms over epoch ms: 1.000 is a perfect prefetcher",
    "over/batch us": "(epoch - bound) / batches: what the arm costs per batch above the bound, "
    "the loader's own work included",
}
"""The columns of the synthetic table, as its legend explains them."""


def wrap(text: str, indent: str = "  ") -> str:
    """``text`` in lines of at most 100 characters, the first indented by ``indent`` and the
    others by two more spaces."""
    return textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent + "  ")


def explain(columns: Mapping[str, str], arms: Iterable[str], *notes: str) -> str:
    """A table's legend: what each of ``columns`` (name: meaning) and of ``arms`` means, with
    ``notes`` after the columns."""
    lines = ["Columns:"]
    lines += [wrap(f"{name}: {text}.") for name, text in columns.items()]
    lines += [wrap(note) for note in notes]
    lines.append("Arms (plain is the baseline, 1.00x by definition):")
    lines += [wrap(f"{arm}: {ARM_NOTES[arm]}.") for arm in dict.fromkeys(arms)]
    return "\n".join(lines)


def legend(arms: Iterable[str]) -> str:
    """What each column and each of ``arms`` in the synthetic table means."""
    return explain(
        COLUMNS,
        arms,
        "bound ms, overlap and over/batch us are given for the arms that prefetch only (plain "
        "and inline make each batch when asked: their best is themselves) and not for loops "
        "with no work.",
    )


def _dash(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_table(results: list[ArmResult]) -> str:
    """Results as fixed-width text, one block per case, its costs and how it differs above it."""
    head = (
        f"  {'arm':<10} {'epoch ms':>9}  {'vs plain':<19} {'bound ms':>9} {'overlap':>8} "
        f"{'over/batch us':>14}"
    )
    lines: list[str] = []
    case: Case | None = None
    for r in results:
        if r.case is not case:
            case = r.case
            if lines:
                lines.append("")
            lines.append(_case_line(r))
            lines.append(head)
        lines.append(
            f"  {r.arm:<10} {r.epoch_s * 1e3:>9.1f}  {r.spread.ratio():<19} "
            f"{_dash(None if r.bound_s is None else r.bound_s * 1e3, '.1f', 9)} "
            f"{_dash(r.overlap_efficiency, '.3f', 8)} {_dash(r.per_batch_us, '.1f', 14)}"
        )
    return "\n".join(lines)


def _case_line(r: ArmResult) -> str:
    case = r.case
    if case.data_ms <= 0 and case.step_ms <= 0:
        cost = "no work: data 0 and step 0 ms a batch"
    else:
        measured = " and ".join(
            f"{v:.3g}" if v is not None else "0" for v in (r.data_call_ms, r.step_call_ms)
        )
        cost = (
            f"{case.kind}: data {case.data_ms:g} and step {case.step_ms:g} ms a batch "
            f"(measured {measured} ms)"
        )
    note = f"\n  ({case.note})" if case.note else ""
    return f"{cost}, {case.batches} batches, {case.rounds} rounds{note}"


Loop = tuple[str, Spread] | tuple[str, Spread, Spread | None]
"""A loop a conclusion reads: its name, the spread of the arm's speed over plain DataLoader's,
and where the run has one, plain DataLoader's against itself in the same rounds (the noise)."""

ADVICE = {
    "mixed": "use it where your data or step work releases the GIL, and time your own loop "
    "against max_prefetch=0 elsewhere",
    "slower": "keep the plain DataLoader here unless your own loop, timed, says otherwise",
    "faster": "switching costs nothing here",
    "faster, unsure": "use it where your loop is like those it was faster in, and time your own "
    "loop against max_prefetch=0 where it is like the others",
    "alike": "switching neither gains nor costs here",
    "alike, unsure": "time your own loop against max_prefetch=0 before switching",
    "unsure": "nothing was decided: run it again on a quiet machine",
}
"""What the closing sentence advises, by which outcomes the loops had (`advice`)."""


def advice(outcomes: Iterable[str]) -> str:
    """What to do, from the loops' outcomes (`prefetchx.bench.paired.compare`'s words).

    A loop slower than plain, read as such, is never followed by "costs nothing"; one the run
    could not tell is never counted as either.
    """
    seen = set(outcomes)
    if "slower" in seen:
        return ADVICE["mixed" if "faster" in seen else "slower"]
    unsure = ", unsure" if "unsure" in seen else ""
    if "faster" in seen:
        return ADVICE["faster" + unsure]
    if "alike" in seen:
        return ADVICE["alike" + unsure]
    return ADVICE["unsure"]


def _quote(name: str, spread: Spread) -> str:
    return f"{spread.median:.2f}x, {name}"


def _counts(read: Sequence[tuple[str, Spread, str, Spread | None]], n: int) -> str:
    """The sentence's middle: how many loops came out each way, and the telling ones."""

    def of(outcome: str) -> list[tuple[str, Spread, str, Spread | None]]:
        return sorted((r for r in read if r[2] == outcome), key=lambda r: r[1].median)

    def count(loops: Sequence[object]) -> str:
        return str(len(loops)) if loops else "none"

    faster, slower, alike, unsure = of("faster"), of("slower"), of("alike"), of("unsure")
    parts = [f"faster in {count(faster)} of {n} loops"]
    if faster:
        parts[0] += f" (up to {_quote(faster[-1][0], faster[-1][1])})"
    parts.append(f"slower in {count(slower)}")
    if slower:
        parts[-1] += f" (down to {_quote(slower[0][0], slower[0][1])})"
    parts.append(f"alike in {count(alike)}")
    text = ", ".join(parts)
    if not unsure:
        return text
    name, spread, _, twin = unsure[0]  # the lowest median: the one a reader most needs
    noise = "" if twin is None else f", plain against itself {twin.low:.2f}x to {twin.high:.2f}x"
    return (
        f"{text}, and too noisy to tell in {len(unsure)} (the lowest {_quote(name, spread)}, "
        f"its rounds {spread.low:.2f}x to {spread.high:.2f}x{noise})"
    )


def _busy(read: Sequence[tuple[str, Spread, str, Spread | None]]) -> str:
    """The clause that says the machine was too busy, where its noise left a loop untold."""
    noisy = [twin for _, _, outcome, twin in read if outcome == "unsure" and twin is not None]
    busy = [twin for twin in noisy if too_busy(twin)]
    if not busy:
        return ""
    worst = max(uncertainty(twin) for twin in busy)
    return (
        f"; the machine was too busy to decide {len(busy)} of them: plain against itself alone "
        f"left a median +/-{worst:.1%} of noise (two standard errors), above the "
        f"{CLEAR:.0%} a difference must clear"
    )


def conclude(loops: Sequence[Loop], *, arm: str = "DataLoaderX", quick: bool = False) -> str:
    """One sentence that says what the runs mean for this machine.

    Each loop is read by `prefetchx.bench.paired.compare`: faster or slower than plain where
    its median lies beyond 1.0 by 2% and by its uncertainty (from its rounds and from plain
    against itself), alike where it lies within 2% and the run could have seen 2%, too noisy
    to tell otherwise. The sentence counts each outcome, quotes the telling loops, says when
    the machine was too busy to decide (`prefetchx.bench.paired.too_busy`), and advises from
    the counts alone (`advice`).

    Args:
        loops: Each loop's name, the spread of ``arm``'s speed over plain DataLoader's, and
            optionally plain DataLoader's against itself in the same rounds.
        arm: How the sentence names the arm.
        quick: The runs were short: the sentence says not to decide from them.
    """
    if not loops:
        return "Nothing was measured."
    read = []
    for loop in loops:
        name, spread, twin = loop[0], loop[1], (loop[2] if len(loop) > 2 else None)
        read.append((name, spread, compare(spread, twin), twin))
    where = (
        "On this machine (a --quick run, too short to decide from)" if quick else "On this machine"
    )
    return (
        f"{where}, against a plain DataLoader, {arm} was {_counts(read, len(read))}"
        f"{_busy(read)}: {advice(r[2] for r in read)}."
    )
