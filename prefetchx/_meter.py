"""`Meter`: the side of an iterator that faces the loop. It takes each outcome from the stages,
counts it, times the loop, and hands the loop's pace to the loader's `Decision`.

Every outcome is counted in the epoch's `EpochStats` (``handed``) right before it is handed over:
the stats outlive the iterator, so a state taken after any way out of the loop counts what the
loop received. The loop is timed in *stretches* of batches, the first starting at the epoch's
second batch (the first's wait holds the epoch's start): a stretch measured in one mode is a
window of the decision's. Where a batch takes over `TIME_EACH_ABOVE_S`, every batch's wait and
the step before it are timed. Below, a stretch times its first two batches, and the step between
them; the others are counted, and at its end get their share of its measured time, so that
totals stay right; while the thread is parked they are made with the source itself, lent by the
thread stage, with nothing of the stage's run between.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from time import perf_counter
from typing import Any

from prefetchx._choose import Decision, Window
from prefetchx._device_stage import DeviceStage
from prefetchx._engine import Failure
from prefetchx._stats import FOLD_EVERY, EpochStats, Tally
from prefetchx._thread_stage import ThreadStage

LONG_STRETCH = 256
"""Batches in a stretch where no decision needs windows (``max_prefetch=0``): the meter's own
work at a stretch's end is then a small share of a loop however fast."""

TIME_EACH_ABOVE_S = 100e-6
"""Above this time per batch the meter times every batch; below, one sample of two batches a
stretch. Two clock reads and two appends a batch cost a loop of no work about 0.8 us on the
2-core VM (its work leaves the meter's code and data out of the caches), 4% of its 20 us: above
100 us a batch, they cost under 1% of it."""


class Meter:
    """The loop-facing side of one epoch's iterator: `next` hands the loop its next outcome.

    Its state is in slots: a batch touches it a dozen times, and an instance attribute of a class
    with ``__getattr__`` (`PrefetchIterator`'s) costs twice a slot's.
    """

    __slots__ = (
        "_add_step",
        "_add_threaded_step",
        "_add_wait",
        "_beside",
        "_decision",
        "_device",
        "_each",
        "_generation",
        "_left",
        "_length",
        "_lent_left",
        "_measured",
        "_produced",
        "_returned",
        "_stage",
        "_stats",
        "_stretch",
        "_stretch_start",
        "_tally",
        "_thread",
        "_timing",
        "lent",
    )

    def __init__(
        self,
        stats: EpochStats,
        thread: ThreadStage[Any],
        stage: ThreadStage[Any] | DeviceStage,
        decision: Decision | None,
        tally: Tally,
        length: int | None,
    ) -> None:
        self._stats = stats
        self._thread = thread
        self._stage = stage
        self._device = stage is not thread
        self._decision = decision
        self._tally = tally
        self._length = length  # the epoch's batches, where known
        self._add_wait = stats.wait.add
        self._add_step = stats.step.add
        self._add_threaded_step = stats.step_threaded.add
        self._timing = True  # whether this batch is timed: always the epoch's first
        self._each = True  # whether every batch of the stretch is timed
        self._returned: float | None = None
        self._beside = False  # whether the thread runs beside the step now running
        self._left = 1  # batches to the stretch's end
        self._stretch = 0  # batches in the stretch
        self._stretch_start: float | None = None  # None before the epoch's second batch
        self._measured = False  # whether the stretch is a window of the decision's
        self.lent: Iterator[Any] | None = None
        """The source, lent by the thread stage for a stretch's untimed batches (`lent_next`)."""
        self._lent_left = 0  # `_left` when it was lent
        self._generation = -1
        self._produced = 0

    def lent_next(self) -> Any:
        """`next` for a fast loop's untimed batch: made with the lent source, with nothing of
        the stages between."""
        lent = self.lent
        assert lent is not None  # only while lent
        try:
            value = next(lent)
        except StopIteration:
            self.return_lent()
            self._thread.ended_by_caller()
            self._finish()
            raise
        except BaseException:  # raised in the batch's place, as by DataLoader
            self._left -= 1
            self._stats.handed += 1
            self._stats.add_errors(1)
            if not self._left:
                self.return_lent()
            del self, lent  # the traceback keeps this frame: not the meter, nor the source
            raise
        self._left -= 1
        self._stats.handed += 1
        if not self._left:
            self.return_lent()
        return value

    def next(self) -> Any:
        """The loop's next outcome: an item; an exception raised in its place; `StopIteration`
        at the end."""
        if not self._left:
            self._boundary()  # before the take: an interrupt here loses no outcome
        timing = self._timing
        if timing:
            asked = perf_counter()
            returned = self._returned
            if returned is not None:
                self._add_step(asked - returned)
                if self._beside:
                    self._add_threaded_step(asked - returned)
        thread = self._thread
        generation = thread.generation
        try:
            if self._device:
                value = self._stage.take()
            elif thread.threaded:  # the thread stage faces the loop: its take(), inlined
                value = thread._from_thread()
            else:
                value = thread._make_here()
        except StopIteration:
            self._finish()
            raise
        # Taken from the thread's queue where it ran before and after, with no switch between;
        # then it also runs beside the step that follows.
        self._beside = thread.threaded
        if self._beside and thread.generation == generation:
            self._stats.from_thread += 1
        if timing:
            now = self._returned = perf_counter()
            self._add_wait(now - asked)
            # In a stretch timed by sample, its first two batches: the step between them too.
            self._timing = self._each or self._left == self._stretch
            if not self._timing:
                self._returned = None
                if not self._device and self._left > 1:
                    # The rest of the stretch with the source itself, where the stage lends it.
                    self.lent = thread.lend()
                    self._lent_left = self._left - 1
        self._left -= 1
        self._stats.handed += 1  # the count: last, right before the outcome is handed over
        if value.__class__ is Failure:
            self._stats.add_errors(1)
            del self  # the traceback keeps this frame: it must not keep the meter alive
            value.reraise()
        return value

    def return_lent(self) -> None:
        """The untimed batches are over (the stretch's end, the source's, a close): count the
        calls made with the lent source back to the stage."""
        if self.lent is not None:
            self.lent = None
            self._thread.made(self._lent_left - self._left)

    def _finish(self) -> None:
        """No more outcomes: the source ended, or the iterator was closed."""
        if self._thread.ended:
            self._tally.ended = True
        if self._decision is not None:
            start = self._stretch_start  # the stretch the end cut short: the loop's time too
            self._decision.epoch_ended(0.0 if start is None else perf_counter() - start)

    def _boundary(self) -> None:
        """Between two stretches, before the next batch is taken: close the one that ended
        (file what it did not time, hand it to the decision as a window), switch the thread
        stage to the mode the decision wants, and begin the next stretch."""
        now = perf_counter()
        stats, thread, decision = self._stats, self._thread, self._decision
        start, batches = self._stretch_start, self._stretch
        if start is None:
            stats.warmup_s = stats.wait.last(1)[0]  # the epoch's first batch, its start in it
        else:
            period = (now - start) / batches
            wait = self._file(now - start, batches)
            measured = self._measured and thread.generation == self._generation
            if decision is not None and measured and not thread.switching:
                self._decide(decision, period, period - wait, batches)
            elif decision is not None:
                decision.unmeasured(now - start, batches)  # around a switch: its cost counts
            self._each = period >= TIME_EACH_ABOVE_S
        self._stretch_start = now
        if decision is not None and (thread.switching or thread.generation != self._generation):
            # A switch under way, or just made: let the thread hand over what it made, or fill
            # its queue, before the next window is measured.
            self._measured = False
            self._stretch = thread.max_prefetch + 1
        else:
            self._measured = True
            self._stretch = decision.window_batches if decision is not None else LONG_STRETCH
        self._left = self._stretch
        self._timing = True
        self._returned = None  # the step before a stretch's first batch is the boundary's
        self._generation = thread.generation
        self._produced = stats.produce.recorded
        if len(stats.wait.pending) >= FOLD_EVERY:
            stats.fold()

    def _file(self, elapsed: float, batches: int) -> float:
        """The stretch's mean wait; where it was timed by sample, its other batches filed.

        A sampled stretch timed its first two batches, and the step between them: the others
        get the mean of their two waits (at most their share of the time left), and the
        steps share the rest equally, so that the stretch's total is its measured time and
        every batch has its samples.
        """
        stats = self._stats
        if self._each:
            waits = stats.wait.last(batches)
            return sum(waits) / len(waits) if waits else 0.0
        timed = stats.wait.last(min(2, batches))
        wait = sum(timed) / len(timed)
        untimed = batches - len(timed)
        rest = elapsed - sum(timed) - stats.step.last(1)[0]
        if untimed > 0:
            wait_each = min(wait, rest / untimed)
            step_each = (rest - untimed * wait_each) / (untimed + 1)
            stats.wait.pending.extend([wait_each] * untimed)
            stats.step.pending.extend([step_each] * (untimed + 1))
            if self._beside:
                stats.step_threaded.pending.extend([step_each] * (untimed + 1))
            wait = (sum(timed) + untimed * wait_each) / batches
        return wait

    def _decide(self, decision: Decision, period: float, step: float, batches: int) -> None:
        """Hand a measured window to the decision, and switch the thread stage as it wants."""
        stats, thread = self._stats, self._thread
        produced = stats.produce.recorded - self._produced
        made = stats.produce.last(produced) if produced > 0 else []
        length = self._length
        window = Window(
            threaded=thread.threaded,
            batches=batches,
            period=period,
            step=max(0.0, step),
            produce=sum(made) / len(made) if made else math.nan,
            remaining=None if length is None else max(0, length - stats.handed),
        )
        wanted = decision.window(window)
        if wanted != thread.threaded:
            thread.switch(wanted)
        stats.parked_because = "" if decision.threaded else decision.note
