"""The stall meter: where an epoch's time went, per batch, cheap enough to stay on."""

from __future__ import annotations

import collections
import math
from typing import Any

WINDOW = 4096
"""Percentiles are taken over the most recent this-many batches; totals and means over all."""

INPUT_BOUND_FRACTION = 0.05
"""Above this share of the loop's time spent waiting for data, the loop is called input-bound."""


FOLD_EVERY = 1024
"""Samples a series gathers before they are folded into its totals and window."""


class Series:
    """Running total and count of a per-batch duration, with a window for percentiles.

    ``add`` is a bare ``list.append`` (the hot path of a loop with no step work pays for every
    call); the samples are folded into the totals every `FOLD_EVERY` batches and before any read.
    Folding takes a prefix of the list with one slice deletion, so a producer thread may keep
    appending meanwhile.
    """

    __slots__ = ("_count", "_recent", "_total", "add", "pending")

    def __init__(self) -> None:
        self._total = 0.0
        self._count = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.pending: list[float] = []
        self.add = self.pending.append

    def fold(self) -> None:
        """Move the pending samples into the totals and the window."""
        n = len(self.pending)
        if n:
            chunk = self.pending[:n]
            del self.pending[:n]
            self._total += sum(chunk)
            self._count += n
            self._recent.extend(chunk)

    @property
    def total(self) -> float:
        self.fold()
        return self._total

    @property
    def count(self) -> int:
        self.fold()
        return self._count

    @property
    def mean(self) -> float:
        self.fold()
        return self._total / self._count if self._count else math.nan

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the window, nearest rank."""
        self.fold()
        if not self._recent:
            return math.nan
        ordered = sorted(self._recent)
        rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
        return ordered[rank]


class Tally:
    """Batches a stage has handed to the loop, and whether it has told the loop the epoch ended.

    Kept apart from the stage so the loader can still read it after the loop drops the stage's
    iterator (which stops the thread): it is how far the loop got, whatever ran ahead. A thread
    stage already counts what it hands over, one wait sample per batch, so its tally reads that
    ``series`` and its hot path pays nothing more; a stage without one calls `add`.
    """

    __slots__ = ("_added", "_series", "ended")

    def __init__(self, series: Series | None = None) -> None:
        self._series = series
        self._added = 0
        self.ended = False

    def add(self) -> None:
        """One more batch handed over."""
        self._added += 1

    @property
    def count(self) -> int:
        """Batches handed over so far."""
        return self._series.count if self._series is not None else self._added


class EpochStats:
    """What one epoch of a loader spent its time on, as seen by the loop that consumes it.

    * ``wait``: time the loop waited inside ``next()`` for a batch (the stall).
    * ``step``: time between getting a batch and asking for the next (the training step).
    * ``produce``: time the thread spent making each batch; a batch the loop made itself, while
      the thread was parked, counts in ``wait`` only.
    * ``occupancy``: batches waiting in the queue when the loop asked the thread for one.

    Examples:
        >>> from prefetchx import DataLoaderX
        >>> loader = DataLoaderX(range(8), batch_size=2)
        >>> _ = list(loader)
        >>> loader.stats.batches
        4
    """

    def __init__(self) -> None:
        self.wait = Series()
        self.step = Series()
        self.produce = Series()
        self.occupancy = Series()

    def fold(self) -> None:
        """Fold every series' pending samples (see `Series`)."""
        for series in (self.wait, self.step, self.produce, self.occupancy):
            series.fold()

    @property
    def batches(self) -> int:
        """Batches handed to the loop."""
        return self.wait.count

    @property
    def inline_batches(self) -> int:
        """Batches the loop pulled itself while the thread was parked (see `ThreadStage`)."""
        # The occupancy is sampled once per batch taken from the thread, and only then.
        return self.wait.count - self.occupancy.count

    @property
    def input_bound_fraction(self) -> float:
        """Share of the loop's time spent waiting for data."""
        busy = self.wait.total + self.step.total
        return self.wait.total / busy if busy > 0 else math.nan

    def verdict(self) -> str:
        """One line that says whether data loading holds the loop back."""
        fraction = self.input_bound_fraction
        if math.isnan(fraction):
            return "no batches yet"
        if fraction > INPUT_BOUND_FRACTION:
            return (
                f"input-bound {fraction:.0%} of the time: more workers, a deeper "
                "max_prefetch or cheaper transforms would help"
            )
        return f"compute-bound: data loading is hidden ({fraction:.1%} of the time waiting)"

    def as_dict(self) -> dict[str, Any]:
        """Flat numbers for TensorBoard, W&B or JSON; durations in seconds."""
        out: dict[str, Any] = {"batches": self.batches, "inline_batches": self.inline_batches}
        for name in ("wait", "step", "produce"):
            series: Series = getattr(self, name)
            out[f"{name}_total_s"] = series.total
            out[f"{name}_mean_s"] = series.mean
            out[f"{name}_p50_s"] = series.percentile(50)
            out[f"{name}_p95_s"] = series.percentile(95)
        out["queue_occupancy_mean"] = self.occupancy.mean
        out["input_bound_fraction"] = self.input_bound_fraction
        return out

    def __str__(self) -> str:
        ms = 1e3
        return (
            f"{self.batches} batches; waited {self.wait.total:.3f} s in all (mean "
            f"{self.wait.mean * ms:.2f} ms, p50 {self.wait.percentile(50) * ms:.2f} ms, p95 "
            f"{self.wait.percentile(95) * ms:.2f} ms); step mean {self.step.mean * ms:.2f} ms; "
            f"produce mean {self.produce.mean * ms:.2f} ms; queue {self.occupancy.mean:.1f} "
            f"batches on average. {self.verdict()}"
        )
