"""The producer thread of the thread stage: `BackgroundGenerator` with its defects fixed, and
the bookkeeping of every producer thread in the process (stopped ones to wait for before a
fork, running ones to stop at exit).

The consumer's side, the windows, the meter and the switch between the thread and the loop,
is `prefetchx._thread_stage.ThreadStage`; the stop protocol's timeouts and the channel are
`prefetchx._engine`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from time import perf_counter
from typing import Any

import torch
from prefetch_generator import BackgroundGenerator

from prefetchx import _engine
from prefetchx._device import set_thread_device
from prefetchx._engine import POLL_INTERVAL, REAPER, Channel, Failure, Reaped, Signal, discard
from prefetchx._stats import EpochStats
from prefetchx._warnings import Warned, capture_in_this_thread

logger = logging.getLogger(__name__)

MAX_PATIENCE = 64
"""Items the caller makes itself, at most, before it wakes a thread that found it doing so
(see `Producer.make`): a loop that steals every item from a thread that cannot keep up (no
step, a fast source) wakes it about once in this many items."""

PARK_WAIT = 0.005
"""Seconds the consumer lets go of the GIL, at most, for a thread it has taken the source back
from to park (see `Producer.let_park`)."""

LET_GO_WAIT = 1.0
"""Seconds the consumer waits, at most, when it leaves a DataLoader multiprocessing iterator
that nothing else uses while the thread is inside a call of it, for that call to return (see
`Producer._let_go`)."""


_stopping: weakref.WeakSet[Producer] = weakref.WeakSet()
"""Producer threads asked to stop that may still be finishing their current call."""


_running: weakref.WeakSet[Producer] = weakref.WeakSet()
"""Every producer thread started and not yet collected, for the exit handler."""
_exit_handler_registered = False


def _at_exit() -> None:
    """Interpreter exit: stop every producer and wait for them, `EXIT_WAIT` seconds in all."""
    producers = [p for p in list(_running) if p.is_alive()]
    for producer in producers:
        producer.stop()
    deadline = time.monotonic() + _engine.EXIT_WAIT
    try:
        for producer in producers:
            producer.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass  # Ctrl-C at exit: stop waiting, as it asks


def settle(timeout: float) -> bool:
    """Wait, up to ``timeout`` seconds in all, for stopped producer threads to end.

    A new DataLoader iterator with workers forks processes; a thread that is still running at a
    fork (here: one an earlier, abandoned iterator asked to stop) may hold a lock the child then
    finds held forever. Leaving an iterator never waits, so a new one waits here instead.

    Returns:
        Whether every stopped producer has ended.
    """
    deadline = time.monotonic() + timeout
    for producer in list(_stopping):
        if producer is not threading.current_thread():
            producer.join(max(0.0, deadline - time.monotonic()))
    REAPER.idle(max(0.0, min(2 * POLL_INTERVAL, deadline - time.monotonic())))
    return not any(p.is_alive() for p in list(_stopping))


class Producer(BackgroundGenerator):  # type: ignore[misc]  # prefetch_generator is untyped
    """The background thread: `BackgroundGenerator` with its defects fixed.

    `BackgroundGenerator` gives the thread and the ``generator`` attribute. This subclass hands
    over through a `Channel` rather than its ``queue.Queue``, and replaces its ``run``: each
    call of the source ends as one value on the channel, an item or a `Failure` (any
    `BaseException`), in order, and the thread goes on after a failure as the source's caller
    would; waits for room are timed and re-check a stop event; the warnings a call raises travel
    with its value; the source is released as soon as the thread ends; the thread can park so
    that the consumer pulls from the source itself; and the consumer can make an item itself
    while the thread has nothing queued and is not making one (`make`). It never references the
    consumer's handle, so a dropped handle can be collected while the thread still runs.
    """

    queue: Channel
    generator: Iterator[Any] | None

    def __init__(
        self,
        source: Iterator[Any],
        max_prefetch: int,
        name: str,
        device: torch.device | None,
        stats: EpochStats,
        reapable: bool,
        allowed: int,
    ) -> None:
        self.stop_event = threading.Event()
        self.pause_requested = threading.Event()
        self.resume_event = threading.Event()
        self.parked = threading.Event()
        """Set while the thread waits in `_park`, from its start until `resume`."""
        self.handed_back = False
        """Whether the source is the consumer's since ``pause_requested`` was last set: the
        thread handed it back (`Signal.PAUSED`) or the consumer took it (`take_back`)."""
        self.calls = 0
        """Calls of the source started, for the reaper and the limit."""
        self.allowed = allowed
        """Once ``calls`` reaches this, the thread hands the source back and ends (see the
        stage's ``limit``); set by the consumer before it starts or resumes the thread."""
        self.retreated = False
        """Whether the thread is trying for the source or has backed off (see `make`)."""
        self.backed_off = False
        """Whether the thread has backed off since it last had the source."""
        self.patience = 1
        """Items the consumer makes itself before it wakes a thread that backed off: doubled at
        each back-off, up to `MAX_PATIENCE`, and 1 again once the thread has the source."""
        self.made_here = 0
        """Items the consumer has made itself since it last woke the thread."""
        self.in_source = False
        """Whether the thread is inside a call of the source now."""
        self.reapable = reapable
        """Whether a call of the source may be abandoned once stopped (see `Reaper`)."""
        self.source_lock = threading.Lock()
        """Held by the thread while it calls the source; whoever holds it may release the source."""
        self._device = device
        self._stats = stats
        self._thread_name = name
        # The thread's lead: `max_prefetch` batches ready and one more, as BackgroundGenerator's
        # queue of `max_prefetch` and the batch its thread holds while it waits for room.
        self._bound = max_prefetch + 1
        # BackgroundGenerator.__init__ sets the source, daemon, and starts the thread.
        super().__init__(source, max_prefetch=max_prefetch)

    def start(self) -> None:
        # BackgroundGenerator.__init__ calls start() itself: name the thread and give it its
        # channel (in place of the queue.Queue made there) before it runs.
        global _exit_handler_registered
        self.name = self._thread_name
        self.queue = Channel(self._bound)
        if not _exit_handler_registered:
            _exit_handler_registered = True
            atexit.register(_at_exit)
        _running.add(self)
        super().start()

    def run(self) -> None:
        # A Reaped may arrive just after the call it was meant for: it ends the thread quietly.
        with contextlib.suppress(Reaped):
            self._produce()

    def _produce(self) -> None:
        # The source stays in self.generator, read under source_lock for each call, so that a
        # stop while the thread is not inside it can release it at once (see `_let_go`).
        stop, q, lock = self.stop_event, self.queue, self.source_lock
        held = capture_in_this_thread()
        try:
            if self._device is not None:
                # A new thread starts on device 0: CUDA work here (DataLoader pins memory in
                # this thread when num_workers=0) must run on the target device.
                set_thread_device(self._device)
            while q.room(stop):  # before the call: the thread never waits with an item in hand
                value: Any
                self.retreated = True  # before the try, so that a consumer that wins sees it
                if not lock.acquire(blocking=False):
                    self._back_off()
                    continue
                if self.backed_off:
                    self.backed_off, self.patience = False, 1
                self.retreated = False
                try:
                    value = self._turn(held)
                finally:
                    lock.release()
                if value is Signal.PAUSED:
                    if not self._park():
                        return
                elif value is Signal.END or value is Signal.STOPPED:
                    return
                del value
        except BaseException as exc:  # in this loop itself, not in the source: the stage ends
            if not stop.is_set():
                q.put(Failure(exc))
                q.put(Signal.END)
        finally:
            # Released here, so DataLoader workers shut down as soon as the producer is done,
            # even while a consumer still holds an exception whose traceback shows this frame.
            with lock:
                self.generator = None
            if stop.is_set():
                # A put that raced with the stop would keep its batch, or an exception whose
                # traceback holds the source, for as long as this thread object lives.
                self.queue.drain()

    def _turn(self, held: list[Any]) -> Any:
        """The thread's next turn, under ``source_lock``: one call of the source, its outcome
        put on the channel; or, in its place, what the thread does now.

        Returns:
            The value put on the channel (`Signal.END` ends the thread); `Signal.PAUSED`: park
            (the source is the consumer's until it resumes the thread); `Signal.STOPPED`: end,
            without another word.
        """
        q, stop = self.queue, self.stop_event
        source = self.generator
        if source is None or stop.is_set():
            return Signal.STOPPED  # released by a stop, or ended by the consumer (see `make`)
        if self.pause_requested.is_set():
            # Asked under the lock, so that no call starts once the consumer has asked: the
            # consumer may even have taken the source back already (see `take_back`).
            if not self.handed_back:
                self.handed_back = True
                q.put(Signal.PAUSED)  # in order: after every item made so far
            return Signal.PAUSED
        if self.calls >= self.allowed:
            # Past the limit the caller makes every call: hand the source back, and end.
            q.put(Signal.PAUSED)
            return Signal.STOPPED
        value: Any
        start = perf_counter()
        self.calls += 1
        self.in_source = True
        try:
            value = next(source)
        except StopIteration:
            value = Signal.END
        except BaseException as exc:
            if stop.is_set():
                discard(exc)
                return Signal.STOPPED  # nobody will take it (a Reaped, or a failure after the stop)
            value = Failure(exc)
        else:
            self._stats.produce.add(perf_counter() - start)
        finally:
            self.in_source = False
            source = None
        if held:
            value = Warned(value, held[:])
            held.clear()
        # Put before the lock is let go: a consumer that takes it finds every item made so far
        # in the channel, so an item it makes itself is the next one.
        q.put(value)
        return value

    def _back_off(self) -> None:
        """The consumer is making the next item itself: wait until it says when to try again.

        Trying again at once would queue the thread behind each of the consumer's calls in
        turn, a wake-up and a GIL hand-off for every item of a loop the thread cannot help
        (the source fast, the step short). Each back-off in a row doubles how many items the
        consumer makes before it wakes the thread (see `make`).
        """
        self.backed_off = True
        self.patience = min(2 * self.patience, MAX_PATIENCE)
        self.queue.nap(self.stop_event)

    def make(self) -> Any:
        """The next outcome, made in the consumer's thread, for a consumer that found nothing
        queued: the stage's ``steal``.

        Made only while this thread is not inside the source and has queued nothing: under
        ``source_lock``, which the thread holds from its call until its put, so the item made
        here is the next one in order, and the calls made here count against ``allowed``.

        Returns:
            The item or a `Failure`; `Signal.END` when the source is exhausted (the thread
            then ends without another call); `Signal.NOT_READY` when the thread is making the
            next item, or must (it is at its limit or has an item queued).
        """
        lock = self.source_lock
        if not lock.acquire(blocking=False):
            return Signal.NOT_READY  # the thread is making the next item
        value: Any = Signal.NOT_READY
        try:
            source = self.generator
            if source is not None and self.calls < self.allowed and self.queue.empty():
                self.calls += 1
                try:
                    value = next(source)
                except StopIteration:
                    self.generator = None
                    value = Signal.END
                except BaseException as exc:
                    value = Failure(exc)
        finally:
            lock.release()
        if self.retreated:  # the thread has backed off, or is about to
            if value is Signal.NOT_READY:
                self.queue.wake_producer()  # the consumer now waits for the thread
            else:
                self.made_here += 1
                if self.made_here >= self.patience:
                    self.made_here = 0
                    self.queue.wake_producer()
        return value

    def _let_go(self, wait: float = 0.0) -> None:
        """Release the source here and now, unless the thread is inside a call of it for
        longer than ``wait`` seconds.

        A DataLoader iterator dropped by its caller shuts its workers down before ``del``
        returns; released here, the last reference to it goes with the consumer's, in the
        consumer's thread, and so do the workers. Left to the thread, they would shut down in
        it, later, while the caller may already be joining them: two threads waiting for one
        child process, of which the one that loses takes it for alive. A call of a DataLoader
        iterator returns as soon as a worker's batch comes, so ``wait`` covers it but for a
        worker that does not answer; then the thread releases the source when its call
        returns (see `Reaper`).
        """
        if wait and threading.current_thread() is not self:  # not a collection in the thread
            acquired = self.source_lock.acquire(timeout=wait)
        else:
            acquired = self.source_lock.acquire(blocking=False)
        if not acquired:
            return
        try:
            source, self.generator = self.generator, None
        finally:
            self.source_lock.release()
        del source

    def _park(self) -> bool:
        """Wait, the source handed to the consumer, until it is handed back or stop is set.

        The wait is not timed: a thread that woke now and then to look would need the GIL each
        time, and a loop that holds the GIL and lets go of it only for moments may keep it
        from getting it for the rest of the epoch, every moment of which it then slows (each
        release wakes it to try again). `resume` and `stop` both set ``resume_event``.
        """
        self.parked.set()
        self.resume_event.wait()
        self.parked.clear()
        self.resume_event.clear()
        return not self.stop_event.is_set()

    def take_back(self) -> bool:
        """For a consumer that has asked the thread to park (``pause_requested``): take the
        source back now, if the thread is not inside a call and has queued nothing.

        The thread would hand it back itself, with `Signal.PAUSED` after the items it queued,
        but only once it gets the GIL; and a loop that holds the GIL, letting go of it only for
        moments, may keep it from getting it for many milliseconds, each slowed by a thread
        that tries. Taken back under ``source_lock`` with nothing queued, the source is the
        consumer's from its next call on, in order: the thread asks for ``pause_requested``
        under the same lock before each call. The consumer then lets the thread park
        (`let_park`).

        Returns:
            Whether the source is the consumer's now.
        """
        lock = self.source_lock
        if not lock.acquire(blocking=False):
            return False  # the thread is making an item, or parking: it says so in the channel
        try:
            if not self.queue.empty():
                return False  # items are queued, or the PAUSED after them: the consumer takes them
            self.handed_back = True
            return True
        finally:
            lock.release()

    def let_park(self) -> None:
        """After `take_back`: let go of the GIL until the thread has parked, at most
        `PARK_WAIT`. It takes the thread a few microseconds once it runs; a thread left trying
        for the GIL would cost the loop a share of every batch."""
        if not self.parked.is_set():
            self.queue.wake_producer()  # from a nap or a wait for room: it parks from there
            self.parked.wait(PARK_WAIT)

    def resume(self) -> None:
        """Give the source back to the thread (the consumer no longer calls it)."""
        self.handed_back = False
        self.pause_requested.clear()  # before the wake-up, or the thread would park again
        # Cleared here, not only by the thread once it runs: a thread the loop keeps from the
        # GIL may not have run yet when the source is taken back again, and `let_park` must
        # then let it in, not take it for parked.
        self.parked.clear()
        self.resume_event.set()
        self.queue.wake_producer()  # a thread that had not parked yet may be asleep elsewhere

    def stop(self) -> None:
        """Ask the thread to stop and free the values it queued.

        The thread ends as soon as its current call of the source returns. This runs from a
        finalizer too (a dropped iterator, interpreter exit), where waiting would hold up an
        exception or Ctrl-C raised in the caller's loop, so it waits for the thread only to
        release a source whose workers DataLoader would shut down here, and only so long
        (see `_let_go`).
        """
        self.stop_event.set()
        self.resume_event.set()  # wake a parked thread so it sees the stop
        self.queue.wake_producer()  # and one waiting for room or backed off
        self.queue.drain()
        self._let_go(LET_GO_WAIT if self.reapable else 0.0)
        if self.is_alive():
            _stopping.add(self)

    def abandon(self) -> None:
        """The consumer is gone (its handle was collected): stop, and reap if it gets stuck."""
        self.stop()
        if self.is_alive() and self.reapable and self.in_source:
            REAPER.watch(self)

    def join_stopped(self) -> bool:
        """Wait up to `JOIN_TIMEOUT` for a stopped thread to end; whether it has ended."""
        if self is threading.current_thread() or not self.is_alive():
            return True
        self.join(_engine.JOIN_TIMEOUT)
        self.queue.drain()  # a put that raced with the stop event
        if self.is_alive() and self.reapable and self.in_source:
            REAPER.watch(self, delay=0.0)  # close() has waited long enough
        if self.is_alive():
            logger.warning(
                "prefetchx: thread %r did not stop within %.0f s; it is still inside the source "
                "iterator and will end when that call returns.",
                self.name,
                _engine.JOIN_TIMEOUT,
            )
            return False
        return True
