"""The stop protocol that every prefetchx stage shares.

One bounded channel between a producer thread and the consumer, one stop event, timed puts and
gets that re-check it, and failures carried as values. The timeouts of the whole package live
here.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import queue
import threading
import time
import traceback
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.1
"""Seconds a blocked put or get waits before it re-checks the stop event or the producer."""

JOIN_TIMEOUT = 10.0
"""Seconds `close()` waits for a producer thread to finish the item it is working on."""

REAP_AFTER = 2.0
"""Seconds a stopped producer may stay inside an abandoned DataLoader iterator (a worker that
never answers) before the `Reaper` makes it let go."""

EXIT_WAIT = 2.0
"""Seconds interpreter exit waits, in all, for producer threads to finish the item they are
making. A thread still inside a torch operation when the interpreter finalizes is ended by
CPython inside that operation's C++ code, which aborts the process ("terminate called without an
active exception") before the remaining exit handlers run; most items finish well within this."""


class Signal(enum.Enum):
    """Control values a producer puts on its queue beside the items."""

    END = "end"
    """The source is exhausted: the consumer raises `StopIteration`."""

    STOPPED = "stopped"
    """The producer was stopped before the end: the consumer raises `StopIteration`."""

    PAUSED = "paused"
    """The producer has parked at the consumer's request, or ended at its limit: the consumer
    now owns the source."""

    NOT_READY = "not ready"
    """Nothing is waiting yet (an answer to a non-blocking take, never put on a queue)."""


class Failure:
    """An exception raised in a producer thread, on its way to the consumer.

    The consumer re-raises ``exc`` itself, so it keeps its type, its message and the traceback of
    the producer's frames; the consumer's frames are appended on the way up.
    """

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def reraise(self) -> NoReturn:
        """Raise the carried exception in the calling thread, once.

        The failure lets go of it first. The traceback holds every frame the exception passed
        through, this one and those whose locals hold this failure among them, so a failure
        still holding it would make a reference cycle, and keep those frames' locals (the
        DataLoader iterator and its workers) until a garbage collection pass. DataLoader
        raises a sampler's error without one: the loop's ``del`` releases them at once.
        """
        exc = self.exc
        del self.exc
        try:
            raise exc
        finally:
            del exc  # the same cycle, through this frame's local


class Channel:
    """The bounded hand-off from one producer thread to one consumer.

    Items travel through a `queue.SimpleQueue` (one C-level lock per put and get, where
    `queue.Queue` takes a Python-level condition twice); at most ``bound`` wait at a time. The
    producer asks for `room` before it makes an item, never with one in hand, so a consumer that
    finds the channel empty while the producer sleeps may make the next item itself (see
    ``ThreadStage``'s ``steal``). A producer that finds the channel full sleeps until the
    consumer takes an item, and then makes one, so its work is spread over the consumer's
    steps, one item after each take. Woken only at a low-water mark, it would make several
    items back to back, holding the GIL for as long as they take, and a step that lets go of
    the GIL (a sleep, a wait on a device) would wait for it at its end: 14% to 25% slower in a
    loop of 20 us sleeping steps on the 2-core VM, and within noise of this over 45 other loops
    (it saved wake-ups only in loops where the thread loses to the caller anyway). Every wait
    is timed and re-checks the stop event, so a stop, a Ctrl-C or a producer that died is
    noticed within `POLL_INTERVAL`.

    The producer alone writes ``_put`` and the consumer alone ``_taken``; each reads the other's
    count, which may be behind but never ahead, and re-checks after saying it waits, so no
    wake-up is lost. A wake-up that arrives after its waiter went on is harmless: the next wait
    returns at once and checks again.
    """

    __slots__ = ("_items", "_put", "_room", "_taken", "_waiting", "bound")

    def __init__(self, bound: int) -> None:
        self.bound = max(1, bound)
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._put = 0
        self._taken = 0
        self._waiting = False

    def qsize(self) -> int:
        """Items waiting now (from the consumer's side, exact; from the producer's, at most)."""
        return max(0, self._put - self._taken)

    def empty(self) -> bool:
        """Whether nothing waits, so that a get would block."""
        return self._items.empty()

    def full(self) -> bool:
        """Whether the producer would have to wait for room."""
        return self._put - self._taken >= self.bound

    @property
    def producer_waits(self) -> bool:
        """Whether the producer is waiting for room now."""
        return self._waiting

    def room(self, stop: threading.Event) -> bool:
        """Wait until the producer may make one more item, or ``stop`` is set.

        Returns:
            ``True`` when there is room, ``False`` when ``stop`` was set first.
        """
        if self._put - self._taken < self.bound:
            return True
        return self._wait_for_room(stop)

    def put(self, item: object) -> None:
        """Put ``item`` now: an item the producer made after `room`, or a last word (a `Signal`,
        a `Failure`), which never waits."""
        self._put += 1  # counted before it can be taken, so the count is never behind
        self._items.put(item)

    def nap(self, stop: threading.Event) -> None:
        """For the producer: wait for `wake_producer` or `POLL_INTERVAL`, unless ``stop`` is
        set."""
        if not stop.is_set():
            with contextlib.suppress(queue.Empty):
                self._room.get(timeout=POLL_INTERVAL)

    def _wait_for_room(self, stop: threading.Event) -> bool:
        room, bound = self._room, self.bound
        while not stop.is_set():
            self._waiting = True
            if self._put - self._taken < bound:  # taken meanwhile: go on
                self._waiting = False
                return True
            with contextlib.suppress(queue.Empty):  # a timeout: check the stop, then again
                room.get(timeout=POLL_INTERVAL)
        self._waiting = False
        return False

    def get(self, producer: threading.Thread, stop: threading.Event) -> object:
        """Take the next value, waiting as long as ``producer`` can still put one.

        The wait is timed, so Ctrl-C reaches the caller promptly and a producer that died
        without a last word is noticed instead of waited for forever.

        Returns:
            The next item, a `Signal` or a `Failure`.
        """
        try:
            value = self._items.get_nowait()  # the common case, without a timed wait
        except queue.Empty:
            return self._wait_for_item(producer, stop)
        self._took_one()
        return value

    def _took_one(self) -> None:
        self._taken += 1
        if self._waiting:
            self._waiting = False
            self._room.put(None)  # the producer sleeps on a full channel: room now

    def _wait_for_item(self, producer: threading.Thread, stop: threading.Event) -> object:
        items = self._items
        while True:
            try:
                value = items.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                if producer.is_alive():
                    continue
                # The producer has ended: whatever it put before ending is in the channel now.
                try:
                    value = items.get_nowait()
                except queue.Empty:
                    break
            self._took_one()
            return value
        if stop.is_set():
            return Signal.STOPPED
        return Failure(
            RuntimeError(
                f"prefetchx producer thread {producer.name!r} ended "
                "without delivering a batch, the end of the epoch or "
                "an error"
            )
        )

    def wake_producer(self) -> None:
        """Wake a producer waiting for room or napping, so that it looks again at once (a stop,
        a request)."""
        self._room.put(None)

    def drain(self) -> None:
        """Drop everything waiting, so its batches are freed now (after a stop)."""
        while True:
            try:
                value = self._items.get_nowait()
            except queue.Empty:
                return
            if isinstance(getattr(value, "item", value), Failure):
                discard(getattr(value, "item", value).exc)


def discard(exc: BaseException) -> None:
    """Free what an exception nobody will see holds: its traceback's frames' locals.

    DataLoader's re-raise of a worker error leaves a cycle through its frames, which would keep
    the DataLoader iterator, and its workers, until a garbage collection pass.
    """
    traceback.clear_frames(exc.__traceback__)


class Reaped(BaseException):
    """Raised inside a producer thread stuck in an abandoned source, to make it let go."""


class Reaper:
    """Makes stopped producer threads let go of abandoned sources they are stuck in.

    DataLoader shuts a dropped iterator's workers down in ``__del__``, terminating a worker that
    does not answer. A producer thread waiting in that iterator for a worker that never answers
    keeps it referenced, so ``__del__`` never runs. A producer that is watched here and is still
    in the same call of its source `REAP_AFTER` seconds after it was stopped gets `Reaped`
    raised in it (CPython's ``PyThreadState_SetAsyncExc``), which it receives the next time it
    runs Python code (DataLoader's wait loop does every 5 s); it then ends and releases the
    source, whose ``__del__`` shuts the workers down in that thread.

    Only sources whose calls are safe to abandon are watched: a DataLoader multiprocessing
    iterator that nothing else uses. The reaper thread runs only while it watches something.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[float, Any, int]] = []
        self._thread: threading.Thread | None = None

    def watch(self, producer: Any, delay: float | None = None) -> None:
        """Reap ``producer`` if it is still in its current call after ``delay`` seconds.

        ``producer`` has ``calls`` (calls of the source started) and ``in_source``.
        """
        due = time.monotonic() + (REAP_AFTER if delay is None else delay)
        with self._lock:
            self._watched.append((due, producer, producer.calls))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="prefetchx-reaper", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                # Done when every watched producer has ended or been reaped: a producer that
                # was only finishing a normal item ends within a poll, and so does this thread.
                self._watched = [w for w in self._watched if w[1].is_alive()]
                if not self._watched:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [w for w in self._watched if w[0] <= now]
                self._watched = [w for w in self._watched if w[0] > now]
            for _, producer, calls in due:
                if producer.is_alive() and producer.in_source and producer.calls == calls:
                    _raise_in(producer, Reaped)
            time.sleep(POLL_INTERVAL)

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the reaper thread to have nothing left to watch."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    ident = thread.ident
    if ident is None:
        return
    changed = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc_type)
    )
    if changed > 1:  # never expected; undo rather than hit another thread
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
    logger.warning(
        "prefetchx: thread %r was still waiting in an abandoned DataLoader iterator %.0f s "
        "after it was stopped; made it let go so the workers shut down.",
        thread.name,
        REAP_AFTER,
    )


REAPER = Reaper()
"""The one reaper of the process."""
