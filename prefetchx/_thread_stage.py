"""The thread stage: a background thread keeps up to ``max_prefetch`` outcomes ready.

This is the consumer's side: who makes the next item (the thread, or the caller while the thread
is parked or before it starts), the hand-over in order, and the limit. The thread itself, with its
whole lifecycle, is `prefetchx._producer.Producer`; whether it should run is decided apart, from
the loop's measured pace (`prefetchx._choose`), and applied here with `ThreadStage.switch`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from prefetchx._checks import check_int
from prefetchx._engine import Failure, Signal
from prefetchx._producer import Producer
from prefetchx._warnings import Warned, show

T = TypeVar("T")


def _ignore(seconds: float) -> None:
    """Where a stage's producer times go when nobody reads them."""


class ThreadStage(Iterator[T], Generic[T]):
    """Run an iterator ahead in a background thread, up to ``max_prefetch`` items.

    Every call of ``source`` ends as one outcome for the consumer, in order: an item, or the
    exception it raised (any `BaseException`), re-raised with its type and traceback. An
    exception does not end the stage: the next ``next()`` goes on with what the source gives
    after it, as calling the source directly would. The stage ends when the source raises
    `StopIteration`, or when it is closed; after that ``next()`` raises `StopIteration`.

    Nothing happens before the first ``next()``: it makes the first item in the caller's thread
    (so whatever the source does first, such as a sampler's random draw, happens where and when
    it would without the stage), then the thread (`prefetch_generator.BackgroundGenerator`'s,
    its defects fixed: the Design page says how) makes the items after it. Warnings the source
    raises in the thread are shown in the caller's thread with the item they came with.

    `switch` parks the thread, in order: it hands over what it made, and the caller makes the
    items from the next on, until `switch` gives the source back to the thread. A `DataLoaderX`
    switches on measurement (the Design page, "Thread or parked: measured"); a stage used on its
    own keeps its thread running.

    Leaving the stage does not wait for the thread: dropping it (garbage collection, an early
    ``break``) or an interrupt asks the thread to stop; a source the thread is not inside is
    released then and there, as dropping it without the stage would; otherwise the thread ends
    when its current call returns, and releases the source then (a ``reapable`` one it stays
    stuck in is reaped). `close` waits for the thread, bounded, and warns when that takes long. A
    Ctrl-C while waiting for an item is raised at once and loses nothing: the item comes with the
    next ``next()``.

    Args:
        source: The iterator to run ahead. Create it on the calling thread.
        max_prefetch: Items kept ready. ``0`` runs no thread: ``next()`` pulls from ``source``
            in the caller's thread.
        name: The thread's name.
        device: The accelerator the thread makes current before it starts, or ``None``.
        limit: Calls of ``source`` the thread may make, counting those the caller made: the
            thread never makes a call past it, and the caller makes every later call itself,
            in its own thread. A DataLoader iterator's ``len()``: what the source does at the
            call that ends an epoch (a sampler's last draw from the loader's generator) is then
            the loop's own, made only if the loop makes it. ``None``: no limit.
        reapable: Whether a call of ``source`` that is still running when the stage is left
            may be abandoned, so that the thread ends and releases the source (a DataLoader
            iterator waiting for a worker that never answers); only for sources nothing else
            uses.
        produced: Called in the thread with the seconds each item took to make.
        source_name: What ``source`` is, for the warnings of a close that waits for it; its
            type's name by default.

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
        limit: int | None = None,
        reapable: bool = False,
        produced: Callable[[float], None] = _ignore,
        source_name: str | None = None,
    ) -> None:
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self._limit = sys.maxsize if limit is None else check_int("limit", limit, minimum=0)
        self._source: Iterator[T] | None = source
        self._made = 0  # calls of the source the caller made
        self._name = name
        self._device = device
        self._reapable = reapable
        self._produced = produced
        self._source_name = source_name
        self._producer: Producer | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._start_after_first = max_prefetch > 0
        self._parking = False  # the thread was asked to park and has not said PARKED yet
        self._resume_after_park = False
        self.threaded = False
        """Whether the thread makes the next items (the caller takes them from its queue)."""
        self.generation = 0
        """Counts the changes of who makes the items, for whoever measures each one's pace."""
        self.ended = False
        """Whether the source raised `StopIteration` (not set by `close`)."""

    def __iter__(self) -> ThreadStage[T]:
        return self

    def __next__(self) -> T:
        value = self.take()
        if value.__class__ is Failure:
            del self  # the traceback keeps this frame: it must not keep the thread's handle
            value.reraise()
        return value  # type: ignore[no-any-return]  # an item of the source

    def take(self) -> Any:
        """The next outcome, for a stage composed after this one: an item, or a value holding
        what the source raised in its place (not raised: whoever faces the loop raises it).
        `StopIteration` at the end. An interrupt while waiting for the thread is raised and
        loses nothing."""
        if self.threaded:
            return self._from_thread()
        return self._make_here()

    def _mode(self, threaded: bool) -> None:
        """Who makes the next items from now on: the thread, or the caller."""
        self.threaded = threaded
        self.generation += 1

    def take_ahead(self) -> Any:
        """An outcome ahead of the loop, for a stage that works on it early (the device stage's
        copies), or a marker saying there is none ready; never waits for the thread.

        While the thread runs: one it has ready. While it is parked: one made here and now, as
        the thread would have made it ahead; but never the source's call past ``limit``, which
        stays the loop's own, and nothing where there is no thread at all (``max_prefetch=0``).
        """
        if self.threaded:
            producer = self._producer
            assert producer is not None  # threaded only once started
            if not producer.ready():
                return Signal.NOT_READY
            return self._from_thread(ahead=True)
        if self.max_prefetch == 0 or self._source is None or self._calls() >= self._limit:
            return Signal.NOT_READY
        return self._make_here()

    @property
    def switching(self) -> bool:
        """Whether the thread was asked to park and has not handed the source back yet."""
        return self._parking

    def switch(self, threaded: bool) -> None:
        """Have the thread make the next items (``threaded``), or the caller.

        Parking is in order: the caller first takes what the thread made (`switching` meanwhile).
        Before the first item this chooses whether the thread starts after it. Past ``limit``
        the caller makes every item, and with ``max_prefetch=0`` there is no thread to switch to.
        """
        if not threaded:
            self._resume_after_park = False
            if self._producer is None:
                self._start_after_first = False
            elif self.threaded and not self._parking:
                self._parking = True
                self._producer.park()
            return
        if self.max_prefetch == 0 or self._source is None:
            return
        if self._parking:
            self._resume_after_park = True
        elif self._producer is None:
            if self._made == 0:
                self._start_after_first = True
            else:
                self._start()
        elif not self.threaded:
            self._resume()

    def _calls(self) -> int:
        """Calls of the source made so far, by the caller and the thread."""
        producer = self._producer
        return self._made + (producer.calls if producer is not None else 0)

    def lend(self) -> Iterator[T] | None:
        """The source itself, for a caller that makes the next items with no call of the stage
        between (a loop too fast for one), or ``None`` where it may not:
        the thread runs or parks, or is still to start after the first item, or the stage has
        ended. Each call the caller makes is counted back with `made`, before any `switch`."""
        if self.threaded or self._parking or self._start_after_first or self._source is None:
            return None
        return self._source

    def made(self, calls: int) -> None:
        """Count ``calls`` of the lent source, made by the caller (see `lend`)."""
        self._made += calls

    def ended_by_caller(self) -> None:
        """The lent source raised `StopIteration` to the caller: the stage has ended."""
        self._end()

    def _make_here(self) -> Any:
        """The next outcome, made in the caller's thread: the first item (the thread starts
        right after it), or any item while the thread is parked, ended or absent."""
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
        if self._start_after_first:
            self._start_after_first = False
            self._start()
        return value

    def _start(self) -> None:
        """Start the thread; it makes the items after those the caller has made. Not past the
        limit: there the caller makes every item."""
        source = self._source
        if source is None or self._made >= self._limit:
            return
        producer = Producer(
            source,
            self.max_prefetch,
            name=self._name,
            device=self._device,
            allowed=self._limit - self._made,
            reapable=self._reapable,
            produced=self._produced,
            source_name=self._source_name,
        )
        self._producer = producer
        # Runs on close(), on garbage collection of this stage and never at interpreter exit
        # (which has its own, bounded wait); it holds the producer, never this stage, and it
        # never waits (see Producer.stop).
        self._finalizer = weakref.finalize(self, producer.abandon)
        self._finalizer.atexit = False
        self._mode(True)

    def _resume(self) -> None:
        producer = self._producer
        assert producer is not None  # resumed only once started
        if not producer.is_alive() or self._calls() >= self._limit:
            return  # it ended at its limit: the rest is the caller's
        producer.resume(self._limit - self._made)  # it counts its own calls against it
        self._mode(True)

    def _from_thread(self, ahead: bool = False) -> Any:
        """The next value from the thread: an item or a `Failure`; `StopIteration` at the end.

        Where the thread has parked, the caller makes the next item (or, ``ahead``, what
        `take_ahead` makes).
        """
        producer = self._producer
        assert producer is not None  # threaded only once started
        # An interrupt here (Ctrl-C, DataLoader's dead-worker signal) propagates; the value
        # stays queued for the next call.
        value = producer.get()
        if value.__class__ is Warned:
            show(value.warnings)
            value = value.item
        if value is Signal.PARKED:
            self._parked()
            return self.take_ahead() if ahead else self.take()
        if value is Signal.END:
            self._end()
            raise StopIteration
        if value.__class__ is Failure and not producer.is_alive() and not producer.ready():
            self.close()  # the thread died without a last word: nothing follows
        return value

    def _parked(self) -> None:
        """The thread handed the source back (asked to, or at its limit)."""
        self._parking = False
        self._mode(False)
        if self._resume_after_park:
            self._resume_after_park = False
            self._resume()

    def _end(self) -> None:
        """The source is exhausted: finish."""
        self.ended = True
        self.close()

    def abandon(self) -> None:
        """Nothing else will use the source: from now on, as with ``reapable=True``."""
        self._reapable = True
        if self._producer is not None:
            self._producer.reapable = True

    def drop(self) -> None:
        """What collecting the stage does, now: its thread is asked to stop, never waited for,
        and reaped if it stays stuck in the source, which nothing else uses."""
        self.abandon()
        if self._finalizer is not None:
            self._finalizer()

    @property
    def inside_source(self) -> bool:
        """Whether the background thread is inside a call of the source now."""
        return self._producer is not None and self._producer.in_source

    @property
    def producer_alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._producer is not None and self._producer.is_alive()

    def close(self) -> None:
        """Stop the thread, drop the queued items and release the source. Idempotent.

        Waits up to 5 s (DataLoader's own wait for a worker it shuts down) for the thread to
        return from the call of the source it is in, warning when that takes long;
        `producer_alive` says afterwards whether it is still there.
        """
        if self._finalizer is not None:
            self._finalizer.detach()
        source, self._source = self._source, None
        if self.threaded:
            self._mode(False)
        self._start_after_first = False
        producer = self._producer
        if producer is not None:
            producer.stop()
            producer.join_stopped()
        del source  # the thread has let go of it too, unless stuck in it

    def __enter__(self) -> ThreadStage[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
