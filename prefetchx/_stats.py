"""The stall meter: where an epoch's time went, per batch, cheap enough to stay on."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable
from typing import Any

WINDOW = 4096
"""Percentiles are taken over the most recent this-many batches; totals and means over all."""

INPUT_BOUND_FRACTION = 0.05
"""Above this share of the loop's time spent waiting for data, the loop is called input-bound."""


FOLD_EVERY = 1024
"""Samples a series gathers before they are folded into its totals and window."""

COMPARE_AT_LEAST = 8
"""Steps the meter needs with the thread running and without it before it compares the two."""

THREAD_SLOWS_ABOVE = 0.05
"""Above this relative slowdown of the step with the thread running, the verdict says so."""


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


class Series:
    """Running total and count of a per-batch duration, with a window for percentiles.

    ``add`` is a bare ``list.append`` (the hot path of a loop with no step work pays for every
    call); the samples are folded into the totals every `FOLD_EVERY` batches and before any read.
    Folding takes a prefix of the list with one slice deletion, so a producer thread may keep
    appending meanwhile.
    """

    __slots__ = ("_count", "_recent", "_total", "add", "pending", "refresh")

    def __init__(self) -> None:
        self._total = 0.0
        self._count = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.pending: list[float] = []
        self.add = self.pending.append
        self.refresh: Callable[[], None] | None = None
        """Called before a fold, for a series whose samples become readable late (GPU events)."""

    def fold(self) -> None:
        """Move the pending samples into the totals and the window."""
        if self.refresh is not None:
            self.refresh()
        n = len(self.pending)
        if n:
            chunk = self.pending[:n]
            del self.pending[:n]
            self._total += sum(chunk)
            self._count += n
            self._recent.extend(chunk)

    def last(self, n: int) -> list[float]:
        """The most recent ``n`` samples (fewer if there are fewer), folded or not.

        Reading the meter folds the samples, so whatever decides from recent samples reads them
        here, never from ``pending`` alone.
        """
        pending = self.pending[-n:] if n > 0 else []  # one slice: a fold may run meanwhile
        if len(pending) >= n:
            return pending
        wanted = n - len(pending)
        older = list(itertools.islice(reversed(self._recent), wanted))
        older.reverse()
        return older + pending

    @property
    def recorded(self) -> int:
        """Samples added so far, folded or not; reading it folds nothing. Exact in the thread
        that adds them and folds them."""
        return self._count + len(self.pending)

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
    """What the loop has received of an epoch: outcomes (batches and errors), and its end.

    Kept apart from the iterator so that the loader can still read it after the loop drops the
    iterator (an early ``break``): it is how far the loop got, whatever ran ahead. The iterator
    counts each outcome in ``stats.handed`` as it hands it over.
    """

    __slots__ = ("_stats", "ended")

    def __init__(self, stats: EpochStats) -> None:
        self._stats = stats
        self.ended = False

    @property
    def count(self) -> int:
        """Outcomes handed over so far: batches, and errors raised in their place."""
        return self._stats.handed


class EpochStats:
    """What one epoch of a loader spent its time on, as seen by the loop that consumes it.

    * ``wait``: time the loop waited inside ``next()``, one sample per batch or error handed to
      it (the stall). The first one is also kept as ``warmup_s``: it includes starting the epoch
      (worker processes, the first batch) and is left out of the verdict.
    * ``step``: time between getting a batch and asking for the next (the training step).
    * ``produce``: time the thread spent making each batch it made; it is wall time, so it
      includes the thread's waits for the GIL. Batches the loop made itself (the first of the
      epoch, and every batch while the thread was parked) count in ``wait`` only.
    * ``step_threaded``: the steps the thread ran beside; the other steps ran with it parked or
      absent. Their means compared are what the thread costs the step, the GIL and the cores
      it takes (`thread_step_cost`).
    * ``gpu_idle``: with a CUDA device stage, the time the caller's stream sat idle waiting for
      each batch, measured on the GPU with events (the first batch's in ``gpu_warmup_s``). The
      loop may wait in ``next()`` while the GPU is still busy with the steps it queued; this is
      what data loading costs the GPU. Read from completed events only, so the last batches
      may be missing while the GPU is still running their steps.

    Each of these series has ``total``, ``count``, ``mean`` and ``percentile(q)`` (0-100, over
    the most recent 4096 samples); durations are in seconds, ``nan`` before any sample.
    ``parked_because`` says why the loop ran without the thread, where it did.

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
        self.step_threaded = Series()
        self.gpu_idle = Series()
        self.warmup_s = math.nan
        """The loop's wait for the epoch's first batch or error; ``nan`` before it."""
        self.gpu_warmup_s = math.nan
        """The caller's stream's idle time before the epoch's first batch; ``nan`` without
        a CUDA device stage or before its events complete."""
        self.handed = 0
        """Batches and errors handed to the loop, counted as each is handed over."""
        self.from_thread = 0
        """Batches and errors taken from the thread's queue; the others the loop made itself."""
        self.parked_because = ""
        """Why the loop ran without the thread, as the probe that chose it measured; "" where it
        ran with the thread (or has none: ``max_prefetch=0``)."""
        self._errors = 0

    def fold(self) -> None:
        """Bring every total up to date now; reading one does it by itself."""
        for series in (self.wait, self.step, self.produce, self.gpu_idle, self.step_threaded):
            series.fold()

    @property
    def errors(self) -> int:
        """Errors raised to the loop in place of a batch."""
        return self._errors

    def add_errors(self, errors: int) -> None:
        """Count ``errors`` more errors raised to the loop."""
        self._errors += errors

    @property
    def batches(self) -> int:
        """Batches handed to the loop."""
        return self.handed - self._errors

    @property
    def inline_batches(self) -> int:
        """Batches and errors the loop made itself, not taken from the thread's queue."""
        return max(0, self.handed - self.from_thread)

    @property
    def input_bound_fraction(self) -> float:
        """Share of the loop's time spent waiting for data, the warm-up left out; ``nan``
        before a second batch."""
        waited = self.wait.total
        if self.wait.count:
            waited -= self.warmup_s
        busy = waited + self.step.total
        return max(0.0, waited) / busy if busy > 0 else math.nan

    @property
    def gpu_idle_fraction(self) -> float:
        """Share of the loop's time the GPU sat idle for data (CUDA device stage), the warm-up
        left out; ``nan`` without GPU samples.

        The mean idle time per batch over the loop's mean time per batch, so batches whose
        events have not completed yet do not count.
        """
        idle = self.gpu_idle.mean
        loops = self.wait.count - 1
        if math.isnan(idle) or loops <= 0:
            return math.nan
        busy = (self.wait.total - self.warmup_s + self.step.total) / loops
        return min(1.0, idle / busy) if busy > 0 else math.nan

    def _inline_steps(self) -> tuple[float, int]:
        """Total and count of the steps with the thread parked or absent."""
        return (
            self.step.total - self.step_threaded.total,
            self.step.count - self.step_threaded.count,
        )

    @property
    def step_inline_mean(self) -> float:
        """Mean step with the thread parked or absent; ``nan`` before any."""
        total, count = self._inline_steps()
        return total / count if count > 0 else math.nan

    @property
    def thread_step_cost(self) -> float:
        """How much longer a step takes with the thread running beside it than without:
        the mean step of each compared, ``0.25`` for 25% longer; ``nan`` until each was
        seen 8 times.

        The thread shares the GIL and the cores with the step: a step that needs them runs
        slower while the thread makes batches, which the loop's waits do not show. The two
        means compare like with like when the steps are alike across the epoch.
        """
        total, count = self._inline_steps()
        threaded = self.step_threaded
        if threaded.count < COMPARE_AT_LEAST or count < COMPARE_AT_LEAST or total <= 0:
            return math.nan
        return threaded.mean / (total / count) - 1

    def _thread_clause(self) -> str:
        """What the verdict adds about the thread: why it was parked, or what it costs the
        step where that was measured."""
        if self.parked_because:
            share = self.inline_batches / max(1, self.handed)
            return f"; ran without the thread for {share:.0%} of the batches: {self.parked_because}"
        if not self.step_threaded.count:
            return ""  # no step ran beside the thread: it cost the step nothing
        cost = self.thread_step_cost
        if math.isnan(cost):
            return ""  # not measured: the step was not timed without the thread often enough
        means = (
            f"{_duration(self.step_threaded.mean)} a step with it running, "
            f"{_duration(self.step_inline_mean)} without"
        )
        if cost > THREAD_SLOWS_ABOVE:
            return f"; the thread slows the step by {cost:.0%} ({means})"
        return f"; the thread does not slow the step ({means})"

    def verdict(self) -> str:
        """One line that says whether data loading holds the loop back, whether the loop ran
        without the thread and why, and whether the thread slows the step.

        With GPU samples, it goes by the GPU's idle time rather than the loop's waits: a loop
        that runs ahead of the GPU may wait in ``next()`` while the GPU is still busy.
        """
        if self.handed == 0:
            return "no batches yet"
        return self._data_verdict() + self._thread_clause()

    def _data_verdict(self) -> str:
        gpu = self.gpu_idle_fraction
        if not math.isnan(gpu):
            if gpu > INPUT_BOUND_FRACTION:
                return (
                    f"input-bound: the GPU waited for data {gpu:.0%} of the time; more "
                    "workers, a deeper max_prefetch or device_prefetch, or cheaper transforms "
                    "would help"
                )
            return f"compute-bound: the GPU waited for data {gpu:.1%} of the time"
        fraction = self.input_bound_fraction
        if math.isnan(fraction):
            return (
                f"not measured yet: one batch, which took {_duration(self.warmup_s)} with the "
                "start of the epoch"
            )
        if fraction > INPUT_BOUND_FRACTION:
            return (
                f"input-bound {fraction:.0%} of the time: more workers, a deeper "
                "max_prefetch or cheaper transforms would help"
            )
        return f"compute-bound: data loading is hidden ({fraction:.1%} of the time waiting)"

    def as_dict(self) -> dict[str, Any]:
        """Flat numbers for TensorBoard, W&B or JSON; durations in seconds, ``nan`` for a figure
        not measured yet."""
        out: dict[str, Any] = {
            "batches": self.batches,
            "errors": self.errors,
            "inline_batches": self.inline_batches,
            "warmup_s": self.warmup_s,
        }
        for name in ("wait", "step", "produce"):
            series: Series = getattr(self, name)
            out[f"{name}_total_s"] = series.total
            out[f"{name}_mean_s"] = series.mean
            out[f"{name}_p50_s"] = series.percentile(50)
            out[f"{name}_p95_s"] = series.percentile(95)
        out["step_threaded_mean_s"] = self.step_threaded.mean
        out["step_inline_mean_s"] = self.step_inline_mean
        out["thread_step_cost"] = self.thread_step_cost
        out["input_bound_fraction"] = self.input_bound_fraction
        out["gpu_idle_total_s"] = self.gpu_idle.total
        out["gpu_idle_mean_s"] = self.gpu_idle.mean
        out["gpu_idle_p95_s"] = self.gpu_idle.percentile(95)
        out["gpu_idle_fraction"] = self.gpu_idle_fraction
        out["gpu_warmup_s"] = self.gpu_warmup_s
        return out

    def __str__(self) -> str:
        errors = f" and {self.errors} errors" if self.errors else ""
        if not self.handed:
            return self.verdict()
        gpu = ""
        if self.gpu_idle.count:
            gpu = (
                f"GPU idle for data {self.gpu_idle.total:.3f} s (mean "
                f"{_duration(self.gpu_idle.mean)}, p95 {_duration(self.gpu_idle.percentile(95))}"
                "). "
            )
        made = (
            f"; the thread made {self.from_thread} of them, mean {_duration(self.produce.mean)}"
            if self.produce.count
            else "; the loop made them all itself"
        )
        steps = f"step mean {_duration(self.step.mean)}" if self.step.count else "no step yet"
        return (
            f"{self.batches} batches{errors}; first after {_duration(self.warmup_s)}; waited "
            f"{self.wait.total:.3f} s in all (mean {_duration(self.wait.mean)}, p50 "
            f"{_duration(self.wait.percentile(50))}, p95 {_duration(self.wait.percentile(95))}); "
            f"{steps}{made}. {gpu}{self.verdict()}"
        )
