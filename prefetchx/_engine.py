"""The stop protocol every prefetchx thread shares: its timeouts, the values a thread hands over
besides items, and the reaper of threads stuck in an abandoned DataLoader iterator.

The timeouts of the whole package live here.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
import traceback
from typing import Any, NoReturn

from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.1
"""Seconds a blocked put or get waits before it re-checks the stop event or the thread."""

JOIN_TIMEOUT = float(MP_STATUS_CHECK_INTERVAL)
"""Seconds `close()` waits, at most, for a thread to return from the call of the source it is in:
what DataLoader itself waits for each worker process when it shuts them down (its
``MP_STATUS_CHECK_INTERVAL``, 5 s), before it gives up on it."""

LET_GO_WAIT = 1.0
"""Seconds a dropped iterator waits, at most, for its DataLoader workers to finish the item each
is making, where its thread is inside the DataLoader iterator: joined here, before the drop
returns, as DataLoader's own shutdown joins them, and never later in another thread, where a
join racing with the caller's own join of a worker can take it for alive. A worker busy longer
(an item of many seconds) is left to DataLoader's shutdown when the thread lets go: an exception
or Ctrl-C in the loop never waits longer than this for it."""

WARN_AFTER = 1.0
"""Seconds a wait for a stopped thread lasts before a warning says what it waits for: past the
time most items take, so that the usual wait for the batch in progress stays quiet, and a thread
stuck in a blocked dataset or worker is never waited for silently."""

REAP_AFTER = 2.0
"""Seconds a stopped thread may stay inside an abandoned DataLoader iterator (a worker that
never answers) before the `Reaper` makes it let go."""

EXIT_WAIT = 2.0
"""Seconds interpreter exit waits, in all, for threads to finish the item they are making. A
thread still inside a torch operation when the interpreter finalizes is ended by CPython inside
that operation's C++ code, which aborts the process ("terminate called without an active
exception") before the remaining exit handlers run; most items finish well within this."""


class Signal(enum.Enum):
    """What a thread hands over besides items, and what a take that must not wait answers."""

    END = "end"
    """The source is exhausted: the consumer raises `StopIteration`."""

    PARKED = "parked"
    """The thread has stopped calling the source, at the consumer's request or at its limit:
    the source is the consumer's from the next call on."""

    NOT_READY = "not ready"
    """Nothing is ready yet: the answer of a take that must not wait (never put on a queue)."""


class Failure:
    """An exception raised in a thread, on its way to the consumer.

    The consumer re-raises ``exc`` itself, so it keeps its type, its message and the traceback of
    the thread's frames; the consumer's frames are appended on the way up.
    """

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def reraise(self) -> NoReturn:
        """Raise the carried exception in the calling thread, once.

        The failure lets go of it first: the traceback holds every frame the exception passed
        through, so a failure still holding it would make a reference cycle and keep those
        frames' locals (the DataLoader iterator and its workers) until a garbage collection.
        """
        exc = self.exc
        del self.exc
        try:
            raise exc
        finally:
            del exc  # the same cycle, through this frame's local


def discard(exc: BaseException) -> None:
    """Free what an exception nobody will see holds: its traceback's frames' locals.

    DataLoader's re-raise of a worker error leaves a cycle through its frames, which would keep
    the DataLoader iterator, and its workers, until a garbage collection pass.
    """
    traceback.clear_frames(exc.__traceback__)


class Reaped(BaseException):
    """Raised inside a thread stuck in an abandoned source, to make it let go."""


class Reaper:
    """Makes stopped threads let go of abandoned sources they are stuck in.

    A dropped DataLoaderX iterator tells its DataLoader iterator's workers to stop, even where its
    thread is inside that iterator waiting for a worker's batch. That wait then never ends:
    DataLoader re-checks its workers every 5 s, finds none failed (they were told to stop), and
    waits again. A thread watched here that is still in
    the same call of its source `REAP_AFTER` seconds after it was stopped gets `Reaped` raised in
    it (CPython's ``PyThreadState_SetAsyncExc``), which it receives the next time it runs Python
    code (at DataLoader's next re-check); it then ends and releases the source.

    Only sources whose calls are safe to abandon are watched: a DataLoader multiprocessing
    iterator that nothing else uses. The reaper thread runs only while it watches something.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[float, Any, int]] = []
        self._thread: threading.Thread | None = None
        self._look = threading.Event()  # wakes the reaper to look again at once

    def watch(self, producer: Any, delay: float = REAP_AFTER) -> None:
        """Reap ``producer`` if it is still in its current call after ``delay`` seconds.

        ``producer`` is a thread with ``calls`` (calls of the source started) and
        ``in_source``.
        """
        due = time.monotonic() + delay
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
                # Done when every watched thread has ended or been reaped: one that was only
                # finishing a normal item ends within a poll, and so does this thread.
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
            self._look.wait(POLL_INTERVAL)
            self._look.clear()

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the reaper to have nothing left to watch, and end."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._look.set()
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
    # Routine since a dropped iterator tells its workers to stop: the thread was left in a wait
    # on their (now silent) result queue, which DataLoader re-checks every 5 s, forever.
    logger.debug(
        "prefetchx: thread %r was still in an abandoned DataLoader iterator %.0f s after it was "
        "stopped; made it let go.",
        thread.name,
        REAP_AFTER,
    )


REAPER = Reaper()
"""The one reaper of the process."""
