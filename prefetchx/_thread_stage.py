"""The thread stage: a background thread keeps up to ``max_prefetch`` batches ready."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch
from prefetch_generator import BackgroundGenerator

from prefetchx._checks import check_int
from prefetchx._device import set_thread_device
from prefetchx._engine import (
    JOIN_TIMEOUT,
    Failure,
    Signal,
    drain,
    get_from,
    put_until_stopped,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Producer(BackgroundGenerator):  # type: ignore[misc]  # prefetch_generator is untyped
    """The background thread: `BackgroundGenerator` with its defects fixed.

    `BackgroundGenerator` gives the thread, the bounded ``queue`` and the ``generator`` attribute.
    This subclass replaces its ``run``: puts are timed and re-check a stop event, every
    `BaseException` travels to the consumer as a `Failure`, and the source iterator is released
    as soon as the thread ends. It never references the consumer's handle, so a dropped handle
    can be collected while the thread still runs.
    """

    queue: queue.Queue[Any]
    generator: Iterator[Any] | None

    def __init__(
        self, source: Iterator[Any], max_prefetch: int, name: str, device: torch.device | None
    ) -> None:
        self.stop_event = threading.Event()
        self._device = device
        self.interrupted = False
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
        stop = self.stop_event
        try:
            if self._device is not None:
                # A new thread starts on device 0; CUDA work here (DataLoader pins memory in this
                # thread when num_workers=0) would otherwise open a context on GPU 0.
                set_thread_device(self._device)
            while not stop.is_set():
                try:
                    item = next(source)  # type: ignore[arg-type]  # None only after the loop
                except StopIteration:
                    put_until_stopped(self.queue, Signal.END, stop)
                    return
                if not put_until_stopped(self.queue, item, stop):
                    return
                del item
        except BaseException as exc:
            put_until_stopped(self.queue, Failure(exc), stop)
        finally:
            # Released here, so DataLoader workers shut down as soon as the producer is done,
            # even while a consumer still holds an exception whose traceback shows this frame.
            source = None

    def stop(self) -> None:
        """Ask the thread to stop and free the batches it queued; returns at once."""
        self.stop_event.set()
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

    After the source is exhausted, after an exception was re-raised, or after `close()`, the
    iterator is finished: `next()` raises `StopIteration`.

    Args:
        source: The iterator to run ahead. Create it on the calling thread.
        max_prefetch: Items kept ready. ``0`` runs no thread: ``next()`` pulls from ``source``
            in the caller's thread, and errors are raised exactly as ``source`` raises them.
        name: The thread's name.
        device: The accelerator the thread makes current before it starts, or ``None``.

    Example:
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
    ) -> None:
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self._source: Iterator[T] | None = None
        self._producer: _Producer | None = None
        if max_prefetch == 0:
            self._source = source
            self._finalizer = None
        else:
            self._producer = _Producer(source, max_prefetch, name, device)
            # Runs on close(), on garbage collection of this handle and at interpreter exit; it
            # holds the producer, never this handle.
            self._finalizer = weakref.finalize(self, self._producer.shutdown)

    def __iter__(self) -> ThreadStage[T]:
        return self

    def __next__(self) -> T:
        producer = self._producer
        if producer is None:
            if self._source is None:
                raise StopIteration
            return next(self._source)
        try:
            value = get_from(producer.queue, producer, producer.stop_event)
        except BaseException:
            # Interrupted while waiting: Ctrl-C, or DataLoader's handler for a dead worker. Stop
            # the thread without waiting for the batch it is busy with, so that the interrupt
            # reaches the caller, and the interpreter can exit, at once.
            producer.interrupted = True
            producer.stop()
            raise
        if isinstance(value, Signal):
            self.close()
            raise StopIteration
        if isinstance(value, Failure):
            self.close()
            value.reraise()
        return value  # type: ignore[return-value]  # anything else is an item of the source

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

    def __enter__(self) -> ThreadStage[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
