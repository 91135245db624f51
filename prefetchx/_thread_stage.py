"""The thread stage: a background thread keeps up to ``max_prefetch`` outcomes ready.

This is the consumer's side: the outcomes handed over in order, the windows the loop is timed
over, the meter, and the switch between the thread and the loop making its own batches. The
thread itself, and what the process keeps of every such thread, is `prefetchx._producer`."""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from operator import length_hint
from time import perf_counter
from typing import Any, Generic, TypeVar

import torch

from prefetchx._adapt import WINDOW, Chooser, Memory
from prefetchx._checks import check_int
from prefetchx._engine import Failure, Signal
from prefetchx._producer import Producer
from prefetchx._stats import FOLD_EVERY, EpochStats, Tally
from prefetchx._warnings import Warned, show

T = TypeVar("T")

COARSE_BELOW_S = 1e-3
"""Below this time per batch, a loop that makes its own batches, with no probe of the thread to
come, has its batches counted rather than each timed. Timing each batch runs the stage's Python
for it, two clock reads and two appends, and a step that leaves the caches cold makes that
dearer: on the 2-core VM, a batch timed cost 3 to 7 us more than one counted in loops of 250 to
570 us (1% to 2% of the loop), and 0.3 us in a loop of no work. The meter then times one batch
in each window of `coarse_window` batches and counts the others, with no Python run per counted
batch (see `ThreadStage.outlet`)."""

COARSE_SPAN_S = 20e-3
"""A counted window lasts about this long. Its end costs the loop about 100 us on the 2-core VM,
however little Python it runs: a window of batches leaves the caches cold for the stage's code
and state (windows of 5 ms cost a loop of no work 1.5% to 2% more than windows of 20 ms,
measured with ``benchmarks/no_work.py``). A change in the loop is seen at the window's end, and
that bounds what seeing it late can cost: the window holds this long's worth of batches at the
pace before the change, and a thread could hide at most the batches' data work, which is part
of that pace, so a loop whose data work stays the same loses at most this long to a thread
started late."""

COARSE_WINDOW = 256 * WINDOW
"""Batches in a counted window at most (a loop of no work takes about 150 ms for them)."""


def coarse_window(period: float) -> int:
    """Batches in a counted window of a loop at ``period`` seconds a batch: `COARSE_SPAN_S`
    of them, from `WINDOW` to `COARSE_WINDOW`."""
    if period * COARSE_WINDOW <= COARSE_SPAN_S:
        return COARSE_WINDOW
    return max(WINDOW, int(COARSE_SPAN_S / period))


_SPECIAL = (Signal, Failure, Warned)
"""Queue values that are not plain items."""

_Counters = tuple[Iterator[Any], list[None], Iterator[bool], int]
"""A counted window's counters (see `ThreadStage._open`): of the source's calls (an iterator
over a list of the source, repeated), the mark that the loop's call past the window empties,
of the source's items; and the window's size."""


class _Raise:
    """An exception met by the outlet's own code (an interrupt at a window's edge), raised to
    the loop as one outcome: `itertools.chain` keeps a part that raised, and goes on to the
    next part once it ends, so the outlet goes on too."""

    __slots__ = ("_exc",)

    def __init__(self, exc: BaseException) -> None:
        self._exc: BaseException | None = exc

    def __iter__(self) -> _Raise:
        return self

    def __next__(self) -> Any:
        exc, self._exc = self._exc, None
        if exc is None:
            raise StopIteration
        try:
            raise exc
        finally:
            del exc


class ThreadStage(Iterator[T], Generic[T]):
    """Run an iterator ahead in a background thread, up to ``max_prefetch`` items.

    Every call of ``source`` ends as one outcome for the consumer, in order: an item, or the
    exception it raised (any `BaseException`), re-raised with its type and traceback. An
    exception does not end the stage: the next ``next()`` goes on with what the source gives
    after it, as calling the source directly would. The stage ends when the source raises
    `StopIteration`, or when it is closed; after that ``next()`` raises `StopIteration`.

    Nothing happens before the first ``next()``: it makes the first item in the caller's thread
    (so whatever the source does first, such as a sampler's random draw, happens where and when
    it would without the stage), then the thread may take over (see below). The thread is a
    `prefetch_generator.BackgroundGenerator` whose defects are fixed: it stops when asked, and
    hands on every exception. Warnings the source raises in the thread are shown in the
    caller's thread with the item they came with.

    Leaving the stage does not wait for the thread: dropping it (garbage collection, an early
    ``break``) or an interrupt asks the thread to stop; a source the thread is not inside is
    released then and there, as dropping it without the stage would; otherwise the thread ends
    when its current call of the source returns, and releases the source then, except that for
    a ``reapable`` source the caller waits up to 1 s for that call to return and releases it
    itself (a DataLoader iterator's workers then shut down before the drop returns, as
    DataLoader's). `close` waits for the thread, bounded. A
    Ctrl-C while waiting for an item is raised at once and loses nothing: the item comes with the
    next ``next()``.

    When the thread has nothing ready and is not making the next item (it is asleep, waiting for
    room, or not yet running again), ``next()`` makes that item itself rather than wait for the
    thread to wake (``steal``), under the lock the thread holds from each call to its put, so
    the order stays the source's. A thread that finds the caller doing so backs off until the
    caller has made 2, 4, 8, ... up to 64 items more, one back-off after another:
    where the thread cannot keep ahead (a fast source, no step), a batch then costs no wake-up;
    where it can, it takes over again as soon as it finds the source free, during a step.

    A thread helps only where what it hides is worth more than what it costs (a hand-off per
    item, and the GIL and the cores it shares with the consumer), and that depends on the
    source, the consumer, the machine and the moment. So by default the stage measures the
    consumer's wall time per item, ``next()`` and the work between two calls together, over
    windows of 16 items, with the thread and without it (the consumer then pulls items itself,
    in order, while the thread waits parked), and keeps the faster; a look at the other mode
    that is plainly slower after its first 4 measured items ends there. It looks again when the
    consumer's pace changes by more than 25%, and less and less often while the answer holds,
    at most every 256 windows. It starts without the thread: the first 4 items after the first
    warm the loop up, the window after them times the step and the source alone, and the
    thread is tried only if both take at least 10 us, as less is not worth a hand-off. A
    loader's next epoch goes on from where the last one's choice stood; with a ``limit``, a
    window ends with the epoch at the latest, so that epochs shorter than a probe still
    decide. The thread's window that ends an epoch hands over what the thread made ahead,
    with nothing more to make: a look that would choose the thread on it is made again in
    the next epoch, and the thread's own such window stays out of its figure. Only one of the
    two ever calls the source at a time.
    A `DataLoaderX` (or `Prefetcher`) whose workers take every CPU tells the stage that a switch
    takes 0.5 s to show in the consumer's pace: there the chooser's windows end with the epoch
    (30 s at most), a switch within one is measured 0.5 s after it, and a change of pace brings
    no look at once.

    The same clock reads feed the stall meter, ``stats``: each item's wait and the step before
    it. In a loop that makes its own items at under 1000 us an item, timing each would cost
    it 1% to 2%: there, for a loop that iterates `outlet` or a chain of `parts` (a
    DataLoaderX's iterator is one), once no look at the thread is due, the meter times the first
    item of each window of about 20 ms (each window of 4096 items at most) and counts the
    others, with no Python run for them. Each counted item gets the timed one's wait, and their
    steps share what is left of the window's time; counts stay exact. ``next()`` on the stage
    itself times every item.

    Args:
        source: The iterator to run ahead. Create it on the calling thread.
        max_prefetch: Items kept ready. ``0`` runs no thread: ``next()`` pulls from ``source``
            in the caller's thread.
        name: The thread's name.
        device: The accelerator the thread makes current before it starts, or ``None``.
        adaptive: Let the consumer pull items itself while that is faster; ``False`` runs the
            thread from the second item on (with ``steal``, the caller still makes the items the
            thread has not started when it asks).
        stats: Where to record the stall meter; a new `EpochStats` by default.
        reapable: Whether a call of ``source`` that is still running when the stage is left
            may be interrupted, so that the thread ends and releases the source (a DataLoader
            iterator waiting for a worker that never answers); only for sources nothing else
            uses.
        limit: Calls of ``source`` the thread may make, counting those the caller made: the
            thread never makes a call past it; it ends there, and the caller makes every later
            call itself, in its own thread. A DataLoader iterator's ``len()``: what the source does
            at the call that ends an epoch (a sampler's last draw from the loader's generator)
            is then the loop's own, made only if the loop makes it. ``None``: no limit.
        steal: Make an item in the caller's thread when the thread has none ready and is not
            making one (see above). ``False``: while the thread runs, it makes every item and
            the caller waits for it (a composed stage that calls the source from its own
            thread only).

    Examples:
        >>> with ThreadStage(iter(range(3)), max_prefetch=2) as stage:
        ...     list(stage)
        [0, 1, 2]
    """

    def __init__(
        self,
        source: Iterator[T],
        max_prefetch: int = 2,
        *,
        name: str = "prefetchx-thread",
        device: torch.device | None = None,
        adaptive: bool = True,
        stats: EpochStats | None = None,
        reapable: bool = False,
        limit: int | None = None,
        steal: bool = True,
        _memory: Memory | None = None,
    ) -> None:
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self._steal = steal
        self._limit = sys.maxsize if limit is None else check_int("limit", limit, minimum=0)
        self._made = 0  # calls of the source made in the caller's thread
        self._reapable = reapable
        self.stats = stats if stats is not None else EpochStats()
        self.tally = Tally(self.stats.wait)
        # The consumer's own reference: the first item, and items while the thread is parked.
        self._source: Iterator[T] | None = source
        self._name = name
        self._device = device
        self._producer: Producer | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._inline = True  # until the thread takes over
        self._to_start = max_prefetch > 0  # the first item is still to come
        self._chooser = (
            Chooser(_memory if _memory is not None else Memory())
            if adaptive and max_prefetch > 0
            else None
        )
        self._pausing = False  # the thread was asked to park; the source has not come back
        self._countdown = WINDOW + 1  # outcomes to the next checkpoint; the first changes it
        self._window = WINDOW  # outcomes in the current window
        self._window_start = 0.0
        self._returned_at: float | None = None
        self._sampling = False  # the next batch is a fast loop's timed one (see `_checkpoint`)
        self._express = False  # the loop iterates `outlet`, which can run counted windows
        self._due = 0  # batches of the counted window to come once the timed one is handed
        self._counters: _Counters | None = None  # of the counted window running (see `_open`)
        self._filed = (0, 0, 0)  # its calls, outcomes and errors the meter has so far
        self._sync_lock = threading.Lock()  # the meter is filed from the loop and from readers
        self._coarse_from = 0.0  # when the counted part of the window began
        self._coarse_length = COARSE_WINDOW  # batches in the counted window to come
        self._estimate = 0.0  # the wait recorded for each counted batch: the timed one's
        self._step_estimate = 0.0  # a counted batch's step, for those filed at a close
        self._add_step = self.stats.step.add
        self._add_wait = self.stats.wait.add
        self._add_occupancy = self.stats.occupancy.add
        ref = weakref.ref(self)  # the meter outlives the stage: it must not keep it alive

        def sync() -> None:
            stage = ref()
            if stage is not None:
                stage._sync()

        self._refresh: Callable[[], None] = sync

    def __iter__(self) -> ThreadStage[T]:
        return self

    def __next__(self) -> T:
        # The hot path of a batch timed on its own: two clock reads and two list appends. A
        # loop too fast to be worth timing gets most of its batches from `outlet` without it.
        if self._due:
            raise StopIteration  # to `outlet`, which runs the counted window due now
        value: Any
        asked_at = perf_counter()
        previous = self._returned_at
        if previous is not None:
            self._add_step(asked_at - previous)
        value = self._make_here() if self._inline else self._from_queue()
        self._returned_at = returned_at = perf_counter()
        if previous is None:
            self.stats.warmup_s = returned_at - asked_at
        self._add_wait(returned_at - asked_at)
        self._countdown -= 1
        if not self._countdown:
            self._checkpoint(facing=True)  # `counted`, written out
        if value.__class__ is Failure:
            self.stats.add_errors(1)
            # The traceback keeps this frame: it must not keep the stage (and its thread) alive.
            del self
            value.reraise()
        return value  # type: ignore[no-any-return]  # an item of the source

    def outlet(self) -> Iterator[T]:
        """The stage's outcomes for a loop that faces it, as ``next()`` hands them, but with
        the counted windows of a loop too fast to time each batch run in C.

        Running Python for each counted batch costs a loop of no work 2% to 3% (measured on
        the 2-core VM with ``benchmarks/no_work.py``). The outlet is an `itertools.chain` of
        parts: this stage itself, whose ``next()`` times each batch, until a counted window is
        due; then the window, the source's calls between C-level counters, which hands over
        the source's batches and exceptions with no Python between the loop and the source;
        then this stage again. What the counters counted tells, exactly and at
        any time, the calls made, the batches and the errors, and whether the source has
        ended. Python runs once a window, at its end, and when the meter is read inside one.
        Every outcome and its order are the source's: an exception leaves the window running,
        as it leaves the stage, and `close` ends the window before its next call of the
        source.
        """
        return itertools.chain.from_iterable(self.parts())

    def parts(self) -> Iterator[Iterator[T]]:
        """The parts of `outlet`, in turn, for a chain of the caller's own (a loop's iterator
        that is an `itertools.chain`, as a DataLoaderX's is without workers)."""
        self._express = True
        return self._segments()

    def _segments(self) -> Iterator[Iterator[T]]:
        """The parts of `outlet`, in turn."""
        while True:
            if not self._due:
                yield self  # timed batch by batch, until a counted window is due or the end
                if self._due:
                    continue
                return  # the source has ended, or the stage was closed
            try:
                counted = self._open()
            except BaseException as exc:  # an interrupt: raised in the loop, which may go on
                yield _Raise(exc)
                continue
            if counted is None:
                return
            yield counted
            del counted  # it holds the source
            try:
                if not self._settle():
                    return  # the source has ended, or the stage was closed
            except BaseException as exc:
                yield _Raise(exc)

    def _open(self) -> Iterator[T] | None:
        """The counted window due: the source's next `_due` calls, its type's ``__next__``
        mapped over an iterator over a list of the source `_due` times, which counts them, then
        over a mark that only the loop's call past the window reaches (``iter(mark.pop, None)``
        empties the list ``mark`` and ends at once, calling nothing). `itertools.compress` hands
        each item on and counts it against ``repeat(True, size)``, which a call that raises
        does not reach. What they counted (`operator.length_hint`, and the mark) tells, exactly
        and at any time, the calls made, the batches and the errors, and whether the source has
        ended. All of it is C, and about 0.2 us a batch cheaper than the `zip` of three
        counters and an `operator.itemgetter` it replaces (a loop of no work, 2-core VM).

        The list's iterator lets go of the list once it is through, so a window that `close`
        runs through holds the source no more; a call in progress holds it until it returns.
        The type's ``__next__`` is what ``next()`` calls, minus two hops: 0.3 us a batch of the
        no-work loop on the 2-core VM.
        """
        with self._sync_lock:  # `close`, from another thread, ends this window or none
            source = self._source
            if source is None:
                return None
            size, self._due = self._due, 0
            calls, mark, items = iter([source] * size), [None], itertools.repeat(True, size)
            self._filed = (0, 0, 0)
            self._counters = (calls, mark, items, size)
            self.stats.wait.refresh = self.stats.step.refresh = self._refresh
        made = map(type(source).__next__, itertools.chain(calls, iter(mark.pop, None)))
        return itertools.compress(made, items)

    def _settle(self) -> bool:
        """A counted window has ended, in the loop's call after its last: with the window
        full (the loop's call past it emptied the mark), or with the source's `StopIteration`
        (then the loop's call was the source's last, and the mark is still there). File its
        batches in the meter: each with the timed batch's wait, their steps each an equal
        share of what is left of the window's time; then decide the next window, or end.

        Returns:
            Whether the stage goes on.
        """
        now = perf_counter()
        with self._sync_lock:
            counters = self._counters
            if counters is None:
                return False  # closed
            calls_left, mark, _, size = counters
            left = length_hint(calls_left)
            ended = bool(mark)
            calls = size - left
            # The window's time: a wait for each call; a step before each call, and before
            # this call where it is the one after a full window.
            steps = calls if ended else calls + 1
            busy = now - self._coarse_from - calls * self._estimate
            step = max(0.0, busy / max(1, steps))
            self._file(counters, step, ended)
            self._counters = None
            self.stats.wait.refresh = self.stats.step.refresh = None
        self._step_estimate = step
        self._made += calls
        if ended:
            self._end()
            return False
        self._returned_at = now - step  # this call's step, the one before it, is timed
        self._checkpoint(facing=True)
        return True

    def _sync(self) -> None:
        """Inside a counted window, file the batches handed so far: the meter is read (its
        `Series.refresh`). The counts are exact; a call of the source still running counts
        as an error until it returns its batch. Each step is the last window's mean."""
        with self._sync_lock:
            counters = self._counters
            if counters is not None:
                self._file(counters, self._step_estimate)

    def _file(self, counters: _Counters, step: float, ended: bool = False) -> None:
        """File in the meter what a counted window's ``counters`` counted so far, less what
        it has filed of the window already: each call of the source after a ``step``; each
        outcome handed over (every call but the one that ``ended`` the source) with the
        timed batch's wait; the outcomes that were no batch as errors."""
        calls_left, _, items_left, size = counters
        calls = size - length_hint(calls_left)
        outcomes = calls - 1 if ended else calls
        errors = outcomes - (size - length_hint(items_left))
        filed_calls, filed_outcomes, filed_errors = self._filed
        stats = self.stats
        stats.wait.pending.extend([self._estimate] * (outcomes - filed_outcomes))
        stats.step.pending.extend([step] * (calls - filed_calls))
        stats.add_errors(errors - filed_errors)
        self._filed = (calls, outcomes, errors)

    @property
    def counting(self) -> bool:
        """Whether the loop is inside a counted window of `outlet`."""
        return self._counters is not None

    def take(self, block: bool) -> Any:
        """The next outcome, for a stage composed after this one; a loop uses ``next()``.

        Returns an item; for an exception, a value that holds it (not raised: that stage
        raises it in its turn); or, when ``block`` is false and there is none to be had, a
        marker saying so. Raises `StopIteration` at the end. An interrupt while waiting is
        raised and loses nothing.

        ``block`` false asks for an outcome ahead of the loop, to work on it early: one the
        thread has ready, never one it is making (with ``steal=False``); while the caller makes
        the items (the thread parked or not started yet, where ``max_prefetch`` allows one),
        the item made here and now, as the thread would have made it ahead, but never the
        source's call past ``limit``, which stays the loop's own.
        """
        if not self._inline:
            producer = self._producer
            assert producer is not None  # threaded only once started
            if block or not producer.queue.empty():  # one consumer: not empty: get won't wait
                value = self._from_queue(make=block)
                if value is not Signal.NOT_READY:
                    return value
            elif not (self._pausing and self._reclaim()):
                return Signal.NOT_READY
            # The thread has parked: ahead of the loop, the caller makes the items now.
        if block or self._source is None:
            return self._make_here()
        if self._chooser is None or self._calls() >= self._limit:
            return Signal.NOT_READY  # no thread, so nothing ahead; or the loop's own call
        return self._make_here()

    def _calls(self) -> int:
        """Calls of the source made so far, by the caller and the thread."""
        producer = self._producer
        return self._made + (producer.calls if producer is not None else 0)

    def counted(self) -> None:
        """For a stage composed after this one: it has handed the loop one outcome.

        That stage faces the loop, so it records the loop's wait and step in `stats`; calling
        this once per outcome, after them, ends the measured windows on which the stage
        decides between the thread and the caller, and folds the meter's samples, as
        ``next()`` does for a loop that uses this stage directly.
        """
        self._countdown -= 1
        if not self._countdown:
            self._checkpoint()

    def _make_here(self) -> Any:
        """The next outcome, made in the caller's thread: the epoch's first item (the thread
        starts right after it), or any item while the thread is parked or absent."""
        source = self._source
        if source is None:
            raise StopIteration
        value: Any
        self._made += 1
        try:
            value = next(source)
        except StopIteration:
            self._end()
            raise
        except BaseException as exc:
            value = Failure(exc)
        if self._to_start:
            self._begin()
        return value

    def _begin(self) -> None:
        """After the epoch's first item: the thread takes over now, or a first window runs
        without it."""
        self._to_start = False
        chooser = self._chooser
        if chooser is None:
            self._start()
            return
        threaded, length = chooser.start()
        length = self._capped(chooser, length, handed=1)
        self._window, self._countdown = length, length + 1  # this item is counted after this
        self._window_start = perf_counter()
        if threaded:
            self._start()

    def _start(self) -> None:
        """Start the thread; it takes over the source after the items the caller has made.

        Not past the limit: the caller makes every item from there on.
        """
        self._to_start = False
        assert self._source is not None  # started only while the epoch runs
        if self._made >= self._limit:
            self._chooser = None
            return
        producer = Producer(
            self._source,
            self.max_prefetch,
            self._name,
            self._device,
            self.stats,
            self._reapable,
            allowed=self._limit - self._made,
        )
        self._producer = producer
        # Runs on close(), on garbage collection of this handle and at interpreter exit; it
        # holds the producer, never this handle, and it never waits.
        self._finalizer = weakref.finalize(self, producer.abandon)
        self._finalizer.atexit = False  # exit has its own, bounded wait (`_producer._at_exit`)
        self._inline = False

    def _from_queue(self, make: bool = True) -> Any:
        """The next value from the thread: an item or a `Failure`; `StopIteration` at the end.

        Where the thread has parked, the caller makes the next item, or with ``make`` false
        (a take that must not wait) gets `Signal.NOT_READY`.
        """
        producer = self._producer
        assert producer is not None  # only inline mode runs without a producer
        waiting = producer.queue.qsize()
        if not waiting:
            if self._pausing:
                if self._reclaim():  # not waiting for the thread to park: it may lack the GIL
                    return self._make_here() if make else Signal.NOT_READY
            elif self._steal:
                # Nothing ready: make the next item here if the thread is not making it
                # (asleep, or not yet running again), rather than wait for it to wake.
                value = producer.make()
                if value is not Signal.NOT_READY:
                    if value is Signal.END:
                        self._end()
                        raise StopIteration
                    return value
        # An interrupt here (Ctrl-C, DataLoader's dead-worker signal) propagates; the thread
        # keeps the value it was making, so the next call gets it.
        value = producer.queue.get(producer, producer.stop_event)
        if value.__class__ in _SPECIAL:
            if value.__class__ is Warned:
                show(value.warnings)
                value = value.item
            if value is Signal.PAUSED:
                self._pausing = False
                self._inline = True  # parked, or ended at its limit: the caller makes the next
                return self._make_here() if make else Signal.NOT_READY
            if value.__class__ is Signal:  # END, or STOPPED after a close
                self._end(value is Signal.END)
                raise StopIteration
        if value.__class__ is Failure and not producer.is_alive() and producer.queue.empty():
            self.close()  # the thread died without a last word (see Channel.get): nothing follows
        self._add_occupancy(waiting)
        return value

    def _reclaim(self) -> bool:
        """While the thread is asked to park: the source is the caller's now if the thread
        has queued nothing and is not inside a call (see `Producer.take_back`)."""
        producer = self._producer
        assert producer is not None  # asked to park only once started
        if not producer.take_back():
            return False
        self._pausing = False
        self._inline = True
        producer.let_park()  # after the switch: an interrupt while it waits loses nothing
        return True

    def _end(self, natural: bool = True) -> None:
        """The source is exhausted (``natural``), or the stage was stopped: finish."""
        if natural:
            self.tally.ended = True
        self.close()

    def _checkpoint(self, facing: bool = False) -> None:
        """A window's end: who makes the next items (see `Chooser`); the meter folds its
        samples when they pile up.

        ``facing``: the loop gets its items from this stage's ``next()``, which then records the
        meter's waits and steps. There, if the loop iterates `outlet`, a loop under
        `COARSE_BELOW_S` a batch that makes its own batches, with no probe of the thread to
        come, gets windows of about `COARSE_SPAN_S` (`coarse_window`) whose first batch alone is
        timed: each of the others is counted with that batch's wait, and at the window's end
        their steps are filed, each an equal share of what is left of the window's time. Every
        count stays exact, and so does the window's time, which is all the chooser weighs,
        unless the timed wait was longer than the others; whether the thread is worth a probe is
        told from the window's mean step and wait, so from the timed batch's wait and the rest.
        """
        now = perf_counter()
        if self._sampling:  # the window's timed batch: `outlet` counts the others
            self._sampling = False
            self._estimate = self.stats.wait.last(1)[0]
            self._step_estimate = self.stats.step.last(1)[0]
            self._window = self._coarse_length
            self._due = self._coarse_length - 1
            self._coarse_from = now
            if self._chooser is not None:
                self._chooser.cut(self._coarse_length)
            return
        period = (now - self._window_start) / self._window
        chooser = self._chooser
        length = WINDOW
        if chooser is not None and self._source is not None:
            if self._pausing:  # the source has not come back yet: the switch is still going on
                length = 1
            else:
                handed = self.stats.wait.recorded  # one a batch or error handed over
                ending = handed >= self._limit
                threaded, length = chooser.window(period, self._means, ending)
                length = self._capped(chooser, length, handed)
                if threaded == self._inline:
                    self._switch(threaded)
        self._window = self._countdown = length
        self._window_start = perf_counter()
        if (
            facing
            and self._express
            and period < COARSE_BELOW_S
            and length == WINDOW
            and self._inline
            and self._source is not None
            and (chooser is None or chooser.steady)
        ):
            self._sampling = True
            self._countdown = 1
            self._coarse_length = coarse_window(period)
        if len(self.stats.wait.pending) >= FOLD_EVERY:
            self.stats.fold()

    def _capped(self, chooser: Chooser, length: int, handed: int) -> int:
        """The chooser's window of ``length`` outcomes, made to end with the epoch where
        ``limit`` says it ends sooner (``handed`` outcomes so far): a window that outlasts every
        epoch would never be measured, and an epoch of fewer batches than a window would never
        decide."""
        left = self._limit - handed
        if 0 < left < length:
            chooser.cut(left)
            return left
        return length

    def _means(self) -> tuple[float, float]:
        """The current window's mean step and mean wait."""
        steps = self.stats.step.last(self._window)
        waits = self.stats.wait.last(self._window)
        return sum(steps) / max(1, len(steps)), sum(waits) / max(1, len(waits))

    def _switch(self, threaded: bool) -> None:
        """Hand the source to the thread, or ask the thread to hand it back, in order."""
        producer = self._producer
        if not threaded:
            assert producer is not None  # threaded only once started
            self._pausing = True
            # The thread answers with Signal.PAUSED after the items it has queued, or the
            # caller takes the source back once it has taken them (`_reclaim`). Not woken here:
            # a thread asleep is no cost to the loop, one trying for the GIL may be.
            producer.pause_requested.set()
        elif producer is None:
            self._start()
        elif self._calls() >= self._limit:
            self._chooser = None  # past the limit the caller makes every item: nothing to decide
        else:
            self._inline = False
            producer.allowed = self._limit - self._made  # it counts its own calls against it
            producer.resume()

    def abandon(self) -> None:
        """Nothing else will use the source: from now on, as with ``reapable=True``."""
        self._reapable = True
        if self._producer is not None:
            self._producer.reapable = True

    @property
    def thread(self) -> threading.Thread | None:
        """The background thread, or ``None`` before the first item and with ``max_prefetch=0``."""
        return self._producer

    @property
    def producer_alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._producer is not None and self._producer.is_alive()

    def close(self) -> None:
        """Stop the thread, drop the queued items and release the source. Idempotent.

        Waits up to 10 s for the thread to finish the call of the source it is in;
        `producer_alive` says afterwards whether it is still there.
        """
        if self._finalizer is not None:
            self._finalizer.detach()
        with self._sync_lock:  # no window opens after this (`_open`)
            source, self._source = self._source, None
            counters = self._counters
            if counters is not None:  # in a counted window: file what the loop took, end it
                self._file(counters, self._step_estimate)
                self._counters = None
                self.stats.wait.refresh = self.stats.step.refresh = None
                collections.deque(counters[0], maxlen=0)  # its next call ends: no source call
        self._due = 0
        self._sampling = False
        producer = self._producer
        if producer is not None:
            producer.stop()
            producer.join_stopped()  # and has it reaped if it is stuck in an abandoned source
        del source  # the thread has let go of it too, unless stuck in it
        self._inline = True  # nothing left to take from the thread
        self._to_start = False

    def __enter__(self) -> ThreadStage[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
