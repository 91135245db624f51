"""A synthetic training loop that measures what the thread stage saves.

Each batch costs the producer ``data_ms`` and the training step ``step_ms`` of one kind of work:

* ``sleep``: `time.sleep`, which releases the GIL (I/O waits behave alike);
* ``numpy``: numpy ufuncs over a large array, single-threaded and releasing the GIL;
* ``python``: a pure-Python loop, which holds the GIL: the control, where no thread can help.

Arms run interleaved in one process with the order rotated every round, and each arm's epoch
time is the median over rounds. Each epoch's ideal comes from the time its own data and step
work took (a sleep on a busy machine overshoots by milliseconds), so overlap efficiency
measures the loader, not the timer.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from prefetch_generator import BackgroundGenerator
from torch.utils.data import DataLoader, Dataset

from prefetchx import __version__
from prefetchx._loader import DataLoaderX

KINDS = ("sleep", "numpy", "python")


class Work:
    """A calibrated amount of one kind of work, about ``ms`` milliseconds, that times itself."""

    def __init__(self, kind: str, ms: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")
        self.kind = kind
        self.ms = ms
        self.spent = 0.0
        self.reps = 0
        self._x = np.linspace(0.0, 1.0, 100_000)
        self._out = np.empty_like(self._x)
        if ms > 0 and kind != "sleep":
            unit = min(self._time_unit() for _ in range(5))
            self.reps = max(1, round(ms / 1e3 / unit))

    def _unit(self) -> None:
        if self.kind == "numpy":
            np.sin(self._x, out=self._out)
        else:
            sum(i * i for i in range(500))

    def _time_unit(self) -> float:
        start = time.perf_counter()
        for _ in range(10):
            self._unit()
        return (time.perf_counter() - start) / 10

    def __call__(self) -> None:
        if self.ms <= 0:
            return
        start = time.perf_counter()
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
        else:
            for _ in range(self.reps):
                self._unit()
        self.spent += time.perf_counter() - start


class WorkDataset(Dataset[torch.Tensor]):
    """``n`` small items, each costing one call of ``work`` to produce."""

    def __init__(self, n: int, work: Work) -> None:
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


ARMS: dict[str, Callable[[Dataset[Any], int], Iterable[Any]]] = {
    "plain": lambda dataset, depth: DataLoader(dataset, batch_size=None),
    "recipe": lambda dataset, depth: RecipeLoader(dataset, batch_size=None, max_prefetch=depth),
    "prefetchx": lambda dataset, depth: DataLoaderX(dataset, batch_size=None, max_prefetch=depth),
}
"""How each arm builds its loader from the dataset and the queue depth."""


@dataclass
class Case:
    """One point of the grid: kind of work, per-batch data and step cost in ms, batches, rounds."""

    kind: str
    data_ms: float
    step_ms: float
    batches: int
    rounds: int = 3
    arms: tuple[str, ...] = ("plain", "recipe", "prefetchx")


@dataclass
class ArmResult:
    """One arm's figures for one case; medians over rounds."""

    case: Case
    arm: str
    epoch_s: float
    epochs_s: list[float]
    ideal_s: float
    overlap_efficiency: float
    speedup: float
    per_batch_us: float


def run_epoch(loader: Iterable[Any], step: Callable[[], None]) -> float:
    """Time one epoch of ``loader`` with ``step`` called once per batch."""
    start = time.perf_counter()
    for _ in loader:
        step()
    return time.perf_counter() - start


def measure(
    case: Case, max_prefetch: int = 2, progress: Callable[[str], None] | None = None
) -> list[ArmResult]:
    """Run every arm on ``case`` for ``case.rounds`` interleaved rounds."""
    data, step = Work(case.kind, case.data_ms), Work(case.kind, case.step_ms)
    dataset = WorkDataset(case.batches, data)
    loaders = {name: ARMS[name](dataset, max_prefetch) for name in case.arms}
    names = list(loaders)
    epochs: dict[str, list[float]] = {name: [] for name in names}
    ideals: dict[str, list[float]] = {name: [] for name in names}
    for r in range(case.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            data.spent = step.spent = 0.0
            epochs[name].append(run_epoch(loaders[name], step))
            # A perfect prefetcher pays the first batch's data, then the larger of the two.
            ideals[name].append(data.spent / case.batches + max(data.spent, step.spent))
        if progress is not None:
            progress(
                f"  {case.kind} data {case.data_ms:g} ms, step {case.step_ms:g} ms: "
                f"round {r + 1}/{case.rounds}"
            )
    plain = statistics.median(epochs["plain"])
    results = []
    for name in names:
        if case.data_ms <= 0 and case.step_ms <= 0:
            ideals[name] = [plain] * case.rounds  # nothing to overlap: at best, cost nothing
        pairs = list(zip(ideals[name], epochs[name], strict=True))
        results.append(
            ArmResult(
                case=case,
                arm=name,
                epoch_s=statistics.median(epochs[name]),
                epochs_s=epochs[name],
                ideal_s=statistics.median(ideals[name]),
                overlap_efficiency=statistics.median(i / e for i, e in pairs),
                speedup=plain / statistics.median(epochs[name]),
                per_batch_us=statistics.median((e - i) / case.batches * 1e6 for i, e in pairs),
            )
        )
    return results


def machine_meta() -> dict[str, Any]:
    """Where and with what a benchmark ran: versions, machine, CPUs, GPU, git commit."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # An installed copy or a copied tree, not a checkout: whoever copied it may say.
        commit = os.environ.get("PREFETCHX_COMMIT", "unknown")
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


def format_table(results: list[ArmResult]) -> str:
    """Results as a fixed-width text table."""
    head = (
        f"{'kind':>6} {'data ms':>8} {'step ms':>8} {'arm':>10} {'epoch ms':>9} "
        f"{'ideal ms':>9} {'overlap':>8} {'speedup':>8} {'over/batch us':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.case.kind:>6} {r.case.data_ms:>8g} {r.case.step_ms:>8g} {r.arm:>10} "
            f"{r.epoch_s * 1e3:>9.1f} {r.ideal_s * 1e3:>9.1f} {r.overlap_efficiency:>8.3f} "
            f"{r.speedup:>8.2f}x {r.per_batch_us:>13.1f}"
        )
    return "\n".join(lines)
