"""A synthetic training loop that measures what the thread stage saves.

Each batch costs the producer ``data_ms`` and the training step ``step_ms`` of sleeping, the work
a thread can overlap. Arms run interleaved in one process, with the order rotated every round, and
each arm's epoch time is the median over rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from prefetch_generator import BackgroundGenerator
from torch.utils.data import DataLoader, Dataset

from prefetchx._loader import DataLoaderX


class SleepyDataset(Dataset[torch.Tensor]):
    """``n`` small items, each costing ``data_s`` seconds of sleep to produce."""

    def __init__(self, n: int, data_s: float) -> None:
        self.n = n
        self.data_s = data_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.data_s:
            time.sleep(self.data_s)
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
    """One point of the grid: per-batch data and step cost, in milliseconds."""

    data_ms: float
    step_ms: float
    batches: int


@dataclass
class ArmResult:
    """One arm's figures for one case."""

    case: Case
    arm: str
    epoch_s: float
    epochs_s: list[float]
    ideal_s: float
    overlap_efficiency: float
    speedup: float
    per_batch_us: float


def run_epoch(loader: Iterable[Any], step_s: float) -> float:
    """Time one epoch of ``loader`` with a sleeping step of ``step_s`` per batch."""
    start = time.perf_counter()
    for _ in loader:
        if step_s:
            time.sleep(step_s)
    return time.perf_counter() - start


def measure(
    case: Case, rounds: int, max_prefetch: int = 2, progress: Callable[[str], None] | None = None
) -> list[ArmResult]:
    """Run every arm on ``case`` for ``rounds`` interleaved rounds."""
    data_s, step_s = case.data_ms / 1e3, case.step_ms / 1e3
    dataset = SleepyDataset(case.batches, data_s)
    loaders = {name: build(dataset, max_prefetch) for name, build in ARMS.items()}
    names = list(loaders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(run_epoch(loaders[name], step_s))
        if progress is not None:
            progress(
                f"  data {case.data_ms:g} ms, step {case.step_ms:g} ms: round {r + 1}/{rounds}"
            )
    # A perfect prefetcher pays the first batch's data cost, then the larger cost per batch.
    ideal = data_s + case.batches * max(data_s, step_s)
    plain = statistics.median(times["plain"])
    results = []
    for name in names:
        epoch = statistics.median(times[name])
        results.append(
            ArmResult(
                case=case,
                arm=name,
                epoch_s=epoch,
                epochs_s=times[name],
                ideal_s=ideal,
                overlap_efficiency=ideal / epoch,
                speedup=plain / epoch,
                per_batch_us=(epoch - ideal) / case.batches * 1e6,
            )
        )
    return results


def as_rows(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Results as plain dicts, for JSON."""
    return [asdict(r) for r in results]


def _overlap(result: ArmResult) -> str:
    # With no data and no step cost there is nothing to overlap.
    return f"{result.overlap_efficiency:.3f}" if result.ideal_s > 0 else "-"


def format_table(results: list[ArmResult]) -> str:
    """Results as a fixed-width text table."""
    head = (
        f"{'data ms':>8} {'step ms':>8} {'arm':>10} {'epoch ms':>9} {'ideal ms':>9} "
        f"{'overlap':>8} {'speedup':>8} {'over/batch us':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.case.data_ms:>8g} {r.case.step_ms:>8g} {r.arm:>10} {r.epoch_s * 1e3:>9.1f} "
            f"{r.ideal_s * 1e3:>9.1f} {_overlap(r):>8} {r.speedup:>8.2f}x "
            f"{r.per_batch_us:>13.1f}"
        )
    return "\n".join(lines)
