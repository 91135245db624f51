"""The stop protocol that every prefetchx stage shares.

One bounded queue between a producer thread and the consumer, one stop event, timed puts and gets
that re-check it, and failures carried as values. The timeouts of the whole package live here.
"""

from __future__ import annotations

import enum
import queue
import threading
from typing import Any

POLL_INTERVAL = 0.1
"""Seconds a blocked put or get waits before it re-checks the stop event or the producer."""

JOIN_TIMEOUT = 10.0
"""Seconds `close()` waits for a producer thread to finish the item it is working on."""


class Signal(enum.Enum):
    """Control values a producer puts on its queue beside the items."""

    END = "end"
    """The source is exhausted: the consumer raises `StopIteration`."""

    STOPPED = "stopped"
    """The producer was stopped before the end: the consumer raises `StopIteration`."""

    PAUSED = "paused"
    """The producer has parked at the consumer's request: the consumer now owns the source."""


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
            q.get_nowait()
        except queue.Empty:
            return
