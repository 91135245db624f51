"""The stop protocol that every prefetchx stage shares.

One bounded queue between a producer thread and the consumer, one stop event, timed puts and gets
that re-check it, and failures carried as values. The timeouts of the whole package live here.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import queue
import threading
import time
import traceback
from typing import Any

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
    """The producer has parked at the consumer's request: the consumer now owns the source."""

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

    def reraise(self) -> None:
        """Raise the carried exception in the calling thread."""
        exc = self.exc
        try:
            raise exc
        finally:
            # Break the cycle exc -> traceback -> this frame -> exc.
            del exc


def put_until_stopped(q: queue.Queue[Any], item: object, stop: threading.Event) -> bool:
    """Put ``item`` on ``q``, waiting for room, until ``stop`` is set.

    Returns:
        ``True`` when the item was put, ``False`` when ``stop`` was set first.
    """
    try:
        q.put_nowait(item)  # the common case, without a timed wait
        return True
    except queue.Full:
        pass
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_INTERVAL)
        except queue.Full:
            continue
        return True
    return False


def get_from(q: queue.Queue[Any], producer: threading.Thread, stop: threading.Event) -> object:
    """Take the next value from ``q``, waiting as long as ``producer`` can still put one.

    The wait is timed, so Ctrl-C reaches the caller promptly and a producer that died without a
    last word is noticed instead of waited for forever.

    Returns:
        The next item, a `Signal` or a `Failure`.
    """
    try:
        return q.get_nowait()  # the common case, without a timed wait
    except queue.Empty:
        pass
    while True:
        try:
            return q.get(timeout=POLL_INTERVAL)
        except queue.Empty:
            if producer.is_alive():
                continue
        # The producer has ended: whatever it put before ending is in the queue now.
        try:
            return q.get_nowait()
        except queue.Empty:
            if stop.is_set():
                return Signal.STOPPED
            return Failure(
                RuntimeError(
                    f"prefetchx producer thread {producer.name!r} ended "
                    "without delivering a batch, the end of the epoch or "
                    "an error"
                )
            )


def drain(q: queue.Queue[Any]) -> None:
    """Drop everything waiting in ``q`` so its batches are freed now."""
    while True:
        try:
            value = q.get_nowait()
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
