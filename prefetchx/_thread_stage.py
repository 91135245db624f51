"""The thread stage: a background thread keeps up to ``max_prefetch`` batches ready."""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch
from prefetch_generator import BackgroundGenerator

from prefetchx._checks import check_int
from prefetchx._device import set_thread_device
from prefetchx._engine import (
    JOIN_TIMEOUT,
    POLL_INTERVAL,
    Failure,
    Signal,
    drain,
    get_from,
    put_until_stopped,
)
from prefetchx._stats import FOLD_EVERY, EpochStats, Tally

logger = logging.getLogger(__name__)

T = TypeVar("T")

ADAPT_WINDOW = 16
"""Batches between two decisions of the inline switch, and the sample each decision uses."""

FIRST_WINDOW = 4
"""The first decision of an epoch comes sooner: every threaded batch of a loop with no step
work costs a hand-off (about 150 us on 2 cores), and the hysteresis corrects a wrong start."""

INLINE_BELOW_S = 50e-6
"""A median step shorter than this leaves nothing for a thread to overlap: produce inline."""

THREAD_ABOVE_S = 200e-6
"""A median step longer than this, while inline, is worth a thread again."""


class _Producer(BackgroundGenerator):  # type: ignore[misc]  # prefetch_generator is untyped
    """The background thread: `BackgroundGenerator` with its defects fixed.

    `BackgroundGenerator` gives the thread, the bounded ``queue`` and the ``generator`` attribute.
    This subclass replaces its ``run``: puts are timed and re-check a stop event, every
    `BaseException` travels to the consumer as a `Failure`, the source iterator is released as
    soon as the thread ends, and the thread can park so that the consumer pulls from the source
    itself. It never references the consumer's handle, so a dropped handle can be collected
    while the thread still runs.
    """

    queue: queue.Queue[Any]
    generator: Iterator[Any] | None

    def __init__(
        self,
        source: Iterator[Any],
        max_prefetch: int,
        name: str,
        device: torch.device | None,
        stats: EpochStats,
    ) -> None:
        self.stop_event = threading.Event()
        self.pause_requested = threading.Event()
        self.resume_event = threading.Event()
        self.interrupted = False
        self._device = device
        self._stats = stats
        self._thread_name = name
        # BackgroundGenerator.__init__ makes Queue(max_prefetch), sets daemon, starts the thread.
        super().__init__(source, max_prefetch=max_prefetch)

    def start(self) -> None:
        # BackgroundGenerator.__init__ calls start() itself; name the thread before it runs.
        self.name = self._thread_name
        super().start()

    def run(self) -> None:
        source: Iterator[Any] | None = self.generator
        self.generator = None  # the thread's frame holds the only reference from here on
        stop, q, produce = self.stop_event, self.queue, self._stats.produce
        try:
            # Intra-op threads are per thread and a new one gets all cores: the step already
            # uses them, so torch work here (normalizing, pinning) runs on one, as DataLoader's
            # own pin-memory thread and its workers do.
            torch.set_num_threads(1)
            if self._device is not None:
                # A new thread starts on device 0; CUDA work here (DataLoader pins memory in this
                # thread when num_workers=0) would otherwise open a context on GPU 0.
                set_thread_device(self._device)
            while not stop.is_set():
                if self.pause_requested.is_set():
                    if not self._park():
                        return
                    continue
                start = time.perf_counter()
                try:
                    item = next(source)  # type: ignore[arg-type]  # None only after the loop
                except StopIteration:
                    put_until_stopped(q, Signal.END, stop)
                    return
                produce.add(time.perf_counter() - start)
                if not put_until_stopped(q, item, stop):
                    return
                del item
        except BaseException as exc:
            put_until_stopped(q, Failure(exc), stop)
        finally:
            # Released here, so DataLoader workers shut down as soon as the producer is done,
            # even while a consumer still holds an exception whose traceback shows this frame.
            source = None

    def _park(self) -> bool:
        """Hand the source to the consumer and wait until it is handed back or stop is set."""
        if not put_until_stopped(self.queue, Signal.PAUSED, self.stop_event):
            return False
        while not self.resume_event.wait(POLL_INTERVAL):
            if self.stop_event.is_set():
                return False
        self.resume_event.clear()
        return not self.stop_event.is_set()

    def resume(self) -> None:
        """Give the source back to the thread (the consumer no longer calls it)."""
        self.pause_requested.clear()  # before the wake-up, or the thread would park again
        self.resume_event.set()

    def stop(self) -> None:
        """Ask the thread to stop and free the batches it queued; returns at once."""
        self.stop_event.set()
        self.resume_event.set()  # wake a parked thread so it sees the stop
        drain(self.queue)

    def join_stopped(self) -> None:
        """Wait up to `JOIN_TIMEOUT` for a stopped thread to end; warn if it does not."""
        if self is threading.current_thread() or not self.is_alive():
            return
        self.join(JOIN_TIMEOUT)
        drain(self.queue)  # a put that raced with the stop event
        if self.is_alive():
            logger.warning(
                "prefetchx: thread %r did not stop within %.0f s; it is still inside the source "
                "iterator and will end when that call returns.",
                self.name,
                JOIN_TIMEOUT,
            )

    def shutdown(self) -> None:
        """Stop the thread and wait for it, unless the consumer was interrupted while waiting."""
        self.stop()
        if not self.interrupted:
            self.join_stopped()


class ThreadStage(Iterator[T], Generic[T]):
    """Run an iterator ahead in a background thread, up to ``max_prefetch`` items.

    The thread is a `prefetch_generator.BackgroundGenerator` whose defects are fixed: it stops
    when asked, it stops when this iterator is closed, garbage collected or exhausted, it hands
    every exception (any `BaseException`) to the consumer with its type and traceback, and it
    releases the source iterator as soon as it ends.

    A thread only helps when the consumer does work between items: with a step shorter than
    `INLINE_BELOW_S` (median of `ADAPT_WINDOW` items) the hand-off would cost more than it
    hides, so the thread parks and the consumer pulls items itself, in order, until its steps
    grow longer than `THREAD_ABOVE_S`; then the thread takes over again. Only one of the two
    ever calls the source at a time.

    After the source is exhausted, after an exception was raised (from the thread or inline),
    after an interrupt while waiting, or after `close()`, the iterator is finished: `next()`
    raises `StopIteration`.

    Args:
        source: The iterator to run ahead. Create it on the calling thread.
        max_prefetch: Items kept ready. ``0`` runs no thread: ``next()`` pulls from ``source``
            in the caller's thread.
        name: The thread's name.
        device: The accelerator the thread makes current before it starts, or ``None``.
        adaptive: Let the consumer pull items itself while its steps are too short for a
            thread to help.

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
    ) -> None:
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self.stats = EpochStats()
        self.tally = Tally(self.stats.wait)
        # The consumer's own reference, used while it pulls items inline.
        self._source: Iterator[T] | None = source
        self._producer: _Producer | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._inline = max_prefetch == 0
        self._adaptive = adaptive and max_prefetch > 0
        self._checkpoint_every = FIRST_WINDOW if self._adaptive else ADAPT_WINDOW
        self._returned_at: float | None = None
        self._add_step = self.stats.step.add
        self._add_wait = self.stats.wait.add
        self._step_samples = self.stats.step.pending
        self._wait_samples = self.stats.wait.pending
        if max_prefetch > 0:
            self._producer = _Producer(source, max_prefetch, name, device, self.stats)
            # Runs on close(), on garbage collection of this handle and at interpreter exit; it
            # holds the producer, never this handle.
            self._finalizer = weakref.finalize(self, self._producer.shutdown)

    def __iter__(self) -> ThreadStage[T]:
        return self

    def __next__(self) -> T:
        # The hot path: a loop with no step work pays for every line here (issue 4 targets
        # >= 0.9x of a plain DataLoader there), so a batch costs two clock reads and two list
        # appends; the rest happens at a checkpoint every `ADAPT_WINDOW` batches.
        asked_at = time.perf_counter()
        if self._returned_at is not None:
            self._add_step(asked_at - self._returned_at)
        if self._inline:
            source = self._source
            if source is None:
                raise StopIteration
            try:
                item = next(source)
            except StopIteration:
                self.tally.ended = True
                self.close()
                raise
            except BaseException:
                self.close()  # an error ends the epoch too, as in the thread
                raise
        else:
            item = self._next_from_thread()
        self._returned_at = returned_at = time.perf_counter()
        self._add_wait(returned_at - asked_at)
        if not len(self._wait_samples) % self._checkpoint_every:
            self._checkpoint()
        return item

    def _checkpoint(self) -> None:
        """Decide who produces the next batches; fold the meter's samples when they pile up."""
        if self._adaptive:
            self._decide()
        if len(self._wait_samples) >= FOLD_EVERY:
            self.stats.fold()

    def _next_from_thread(self) -> T:
        producer = self._producer
        assert producer is not None  # only inline mode runs without a producer
        self.stats.occupancy.add(producer.queue.qsize())
        try:
            value = get_from(producer.queue, producer, producer.stop_event)
        except BaseException:
            # Interrupted while waiting: Ctrl-C, or DataLoader's handler for a dead worker. Stop
            # the thread without waiting for the batch it is busy with, so that the interrupt
            # reaches the caller, and the interpreter can exit, at once.
            producer.interrupted = True
            producer.stop()
            raise
        if value is Signal.PAUSED:
            self._inline = True
            return self._next_after_park()
        if isinstance(value, Signal):
            if value is Signal.END:  # not when stopped early
                self.tally.ended = True
            self.close()
            raise StopIteration
        if isinstance(value, Failure):
            self.close()
            value.reraise()
        return value  # type: ignore[return-value]  # anything else is an item of the source

    def _next_after_park(self) -> T:
        """The first item after the thread parked: the caller pulls it itself."""
        assert self._source is not None  # the thread parks only while the epoch runs
        try:
            return next(self._source)
        except StopIteration:
            self.tally.ended = True
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _decide(self) -> None:
        """Who produces the next batches: the majority of the last steps decides.

        More than half of the window short is the median below the threshold, without a sort.
        """
        window = self._step_samples[-self._checkpoint_every :]
        self._checkpoint_every = ADAPT_WINDOW  # the first decision comes after FIRST_WINDOW
        if not window:
            return
        threshold = THREAD_ABOVE_S if self._inline else INLINE_BELOW_S
        mostly_short = 2 * sum(1 for step in window if step < threshold) > len(window)
        producer = self._producer
        assert producer is not None  # adaptive only with a producer
        if not self._inline and mostly_short:
            producer.pause_requested.set()  # the thread answers with Signal.PAUSED, in order
        elif self._inline and not mostly_short:
            self._go_threaded()

    def _go_threaded(self) -> None:
        self._inline = False
        assert self._producer is not None  # adaptive only with a producer
        self._producer.resume()

    @property
    def thread(self) -> threading.Thread | None:
        """The background thread, or ``None`` with ``max_prefetch=0``."""
        return self._producer

    @property
    def producer_alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._producer is not None and self._producer.is_alive()

    def close(self) -> None:
        """Stop the thread, drop the queued items and release the source. Idempotent.

        Waits up to `prefetchx._engine.JOIN_TIMEOUT` seconds for the thread to finish the item it
        is producing.
        """
        if self._finalizer is not None:
            self._finalizer()
        if self._producer is not None:
            self._producer.join_stopped()
        self._source = None
        self._inline = True  # nothing left to take from the thread

    def __enter__(self) -> ThreadStage[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
