"""`Producer`: the background thread of a thread stage, and its whole lifecycle.

Start, park, resume, stop, abandon and join all live in this one class; what the process keeps of
every such thread (stopped ones to wait for before a fork, running ones to stop at exit) is at
the bottom of the module. The consumer's side (who makes the next item, the limit, the hand-over
in order) is `prefetchx._thread_stage.ThreadStage`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import torch
from prefetch_generator import BackgroundGenerator

from prefetchx import _engine
from prefetchx._device import set_thread_device
from prefetchx._engine import POLL_INTERVAL, REAPER, Failure, Reaped, Signal, discard
from prefetchx._warnings import Warned, capture_in_this_thread

logger = logging.getLogger(__name__)

_STOPPED = object()
"""What a call of the source ends as once the thread is stopped: nothing to hand over."""


class Producer(BackgroundGenerator):  # type: ignore[misc]  # prefetch_generator is untyped
    """The thread that runs a source ahead into a bounded queue, for one consumer.

    What it keeps of `prefetch_generator.BackgroundGenerator`: the daemon thread, its
    ``queue.Queue(max_prefetch)`` and the source in ``generator``, so that the thread holds one
    item while it waits for room, ``max_prefetch + 1`` items ahead in all, as the widely copied
    recipe runs. What it replaces, its ``run``, for the recipe's defects (a ``put`` that waits
    forever, a catch of `Exception` alone): each call of the source ends as one value in the
    queue, in order, an item or a `Failure` for any `BaseException`, and the thread goes on
    after a failure as the source's caller would; every wait is timed and re-checks a stop
    event; the warnings a call raises travel with its value; and the source is released as soon
    as the thread ends.

    Its lifecycle, driven by the consumer:

    * started by the constructor, after the consumer made the first item;
    * `park`: before its next call it hands over `Signal.PARKED`, after every item it made, and
      waits; from then on the consumer calls the source itself, in order;
    * `resume`: the consumer no longer calls the source, and the thread goes on;
    * at ``allowed`` calls it hands over `Signal.PARKED` and ends: the consumer makes every
      later call (a stage's ``limit``);
    * `stop`: it ends as soon as its current call returns; nothing it made is handed over any
      more; `stop` never waits;
    * `join_stopped`: wait for it to end, bounded, saying so when it takes long;
    * `abandon`: `stop` for a consumer that is gone, and the `Reaper` if the thread stays stuck
      in a source nothing else uses.
    """

    queue: queue.Queue[Any]
    generator: Iterator[Any] | None

    def __init__(
        self,
        source: Iterator[Any],
        max_prefetch: int,
        *,
        name: str,
        device: torch.device | None,
        allowed: int,
        reapable: bool,
        produced: Callable[[float], None],
        source_name: str | None = None,
    ) -> None:
        self.stop_event = threading.Event()
        self.park_requested = threading.Event()
        self.resume_event = threading.Event()
        self.calls = 0
        """Calls of the source the thread started, for the limit and the reaper."""
        self.allowed = allowed
        """The thread's calls of the source at most: at this many it hands the source back and
        ends. Set by the consumer before it starts or resumes the thread."""
        self.in_source = False
        """Whether the thread is inside a call of the source now."""
        self.reapable = reapable
        """Whether a call of the source may be abandoned once stopped (see `Reaper`)."""
        self.source_lock = threading.Lock()
        """Held by the thread while it calls the source; whoever holds it may release the source."""
        self._device = device
        self._produced = produced
        self._thread_name = name
        self.source_name = source_name if source_name is not None else describe(source)
        """What the thread calls, named for the warnings that say what a wait is for."""
        # BackgroundGenerator.__init__ makes the queue, sets the source and daemon, and starts.
        super().__init__(source, max_prefetch=max_prefetch)

    def start(self) -> None:
        # Called by BackgroundGenerator.__init__: name the thread before it runs.
        self.name = self._thread_name
        _register(self)
        super().start()

    def run(self) -> None:
        # A Reaped may arrive just after the call it was meant for: it ends the thread quietly.
        with contextlib.suppress(Reaped):
            self._produce()

    def _produce(self) -> None:
        stop = self.stop_event
        held = capture_in_this_thread()
        try:
            if self._device is not None:
                # A new thread starts on device 0: CUDA work here (DataLoader pins memory in
                # this thread when num_workers=0) must run on the target device.
                set_thread_device(self._device)
            while not stop.is_set():
                if self.calls >= self.allowed:
                    self._hand(Signal.PARKED)  # the rest is the consumer's: end
                    return
                if self.park_requested.is_set():
                    if not self._hand(Signal.PARKED) or not self._parked():
                        return
                    continue
                value = self._call(held)
                if value is _STOPPED or not self._hand(value) or value is Signal.END:
                    return
                del value  # not held while waiting for the next call
        except BaseException as exc:  # in this loop itself, not in the source: the stage ends
            if not stop.is_set():
                self._hand(Failure(exc))
                self._hand(Signal.END)
        finally:
            # Released here, so DataLoader workers shut down as soon as the thread is done,
            # even while a consumer still holds an exception whose traceback shows this frame.
            with self.source_lock:
                self.generator = None
            if stop.is_set():
                self._drain()  # a put that raced with the stop would keep its item alive

    def _call(self, held: list[Any]) -> Any:
        """One call of the source, under ``source_lock``: its outcome, `Signal.END`, or
        `_STOPPED` when the thread was stopped before or during it."""
        with self.source_lock:
            source = self.generator
            if source is None or self.stop_event.is_set():
                return _STOPPED
            value: Any
            start = perf_counter()
            self.calls += 1
            self.in_source = True
            try:
                value = next(source)
            except StopIteration:
                value = Signal.END
            except BaseException as exc:
                value = Failure(exc)
            else:
                self._produced(perf_counter() - start)
            finally:
                self.in_source = False
                del source
        if self.stop_event.is_set() and value.__class__ is Failure:
            # A Reaped, or a failure nobody will take. Freed out of the call: its frames may
            # hold the last reference to a DataLoader iterator, whose shutdown then runs here.
            discard(value.exc)
            return _STOPPED
        if held:
            value = Warned(value, held[:])
            held.clear()
        return value

    def _hand(self, value: Any) -> bool:
        """Put ``value`` in the queue, waiting for room; ``False`` if stopped meanwhile."""
        put, stop = self.queue.put, self.stop_event
        while not stop.is_set():
            try:
                put(value, timeout=POLL_INTERVAL)
            except queue.Full:
                continue
            return True
        return False

    def _parked(self) -> bool:
        """Wait, the source handed to the consumer, until `resume` or `stop`; whether to go on.

        Not timed: `resume` and `stop` both set ``resume_event``.
        """
        self.resume_event.wait()
        self.resume_event.clear()
        return not self.stop_event.is_set()

    def get(self) -> Any:
        """For the consumer: the next value, waiting as long as the thread can still put one.

        The wait is timed, so Ctrl-C reaches the caller promptly (the value stays queued for the
        next call) and a thread that died without a last word is noticed rather than waited for
        forever.

        Returns:
            An item, a `Failure`, a `Warned`, `Signal.PARKED` or `Signal.END`.
        """
        take = self.queue.get
        while True:
            try:
                return take(timeout=POLL_INTERVAL)
            except queue.Empty:
                if self.is_alive():
                    continue
            try:  # it has ended: whatever it put before ending is in the queue now
                return self.queue.get_nowait()
            except queue.Empty:
                if self.stop_event.is_set():
                    return Signal.END
                return Failure(
                    RuntimeError(
                        f"prefetchx thread {self.name!r} ended without handing over an item, the "
                        "end of the source or an error"
                    )
                )

    def ready(self) -> bool:
        """For the consumer: whether a value is queued, so that `get` will not wait."""
        return not self.queue.empty()

    def park(self) -> None:
        """Ask the thread to hand the source back (`Signal.PARKED`) before its next call."""
        self.park_requested.set()

    def resume(self, allowed: int) -> None:
        """Give the source back to the parked thread, for at most ``allowed`` calls in all."""
        self.allowed = allowed
        self.park_requested.clear()  # before the wake-up, or it would park again
        self.resume_event.set()

    def stop(self) -> None:
        """Ask the thread to end, and free the values it queued.

        The thread ends as soon as its current call of the source returns. This runs from
        finalizers too (a dropped iterator, interpreter exit), where waiting would hold up an
        exception or Ctrl-C raised in the caller's loop, so it never waits: a source the thread
        is not inside is released here and now (see `_let_go`), the rest when the call returns.
        """
        self.stop_event.set()
        self.resume_event.set()  # wake a parked thread, so it sees the stop
        self._drain()  # and make room for a put in progress
        self._let_go()
        if self.is_alive():
            _stopping.add(self)

    def abandon(self) -> None:
        """`stop` for a consumer that is gone; reap the thread if it stays stuck in the source."""
        self.stop()
        if self.is_alive() and self.reapable and self.in_source:
            REAPER.watch(self)

    def join_stopped(self) -> bool:
        """After `stop`: wait up to `JOIN_TIMEOUT` for the thread to end; whether it has.

        A thread that is still inside ``source`` after `WARN_AFTER` gets a warning naming what it
        waits for, so that a wait is never silent; one still there at the end gets a second.
        """
        if self is threading.current_thread() or not self.is_alive():
            return True
        first = min(_engine.WARN_AFTER, _engine.JOIN_TIMEOUT)
        self.join(first)
        if self.is_alive():
            warnings.warn(
                f"prefetchx: waiting up to {_engine.JOIN_TIMEOUT:g} s for thread {self.name!r} "
                f"to return from a call of {self.source_name} (a blocked dataset or worker?).",
                RuntimeWarning,
                stacklevel=4,
            )
            self.join(_engine.JOIN_TIMEOUT - first)
        self._drain()  # a put that raced with the stop event
        if not self.is_alive():
            return True
        if self.reapable and self.in_source:
            REAPER.watch(self, delay=0.0)  # waited long enough: make it let go now
        warnings.warn(
            f"prefetchx: thread {self.name!r} did not return from {self.source_name} within "
            f"{_engine.JOIN_TIMEOUT:g} s; it ends when that call returns.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False

    def _let_go(self) -> None:
        """Release the source here and now, unless the thread is inside a call of it; then the
        thread releases it when the call returns.

        A DataLoader iterator released here shuts its workers down in this thread, before the
        drop or close returns, as DataLoader's own does. (Where the thread is inside it, a
        dropped iterator tells them to stop: see `PrefetchIterator.__del__`.)
        """
        lock = self.source_lock
        if not lock.acquire(blocking=False):
            return
        try:
            source, self.generator = self.generator, None
        finally:
            lock.release()
        del source

    def _drain(self) -> None:
        """Drop everything queued, so its items are freed now."""
        while True:
            try:
                value = self.queue.get_nowait()
            except queue.Empty:
                return
            value = value.item if isinstance(value, Warned) else value
            if isinstance(value, Failure):
                discard(value.exc)


def describe(source: object) -> str:
    """The qualified name of ``source``'s type, for messages."""
    return f"{type(source).__module__}.{type(source).__qualname__}"


_stopping: weakref.WeakSet[Producer] = weakref.WeakSet()
"""Threads asked to stop that may still be finishing their current call."""

_running: weakref.WeakSet[Producer] = weakref.WeakSet()
"""Every thread started and not yet collected, for the exit handler."""

_exit_handler_registered = False


def _register(producer: Producer) -> None:
    global _exit_handler_registered
    if not _exit_handler_registered:
        _exit_handler_registered = True
        atexit.register(_at_exit)
    _running.add(producer)


def _at_exit() -> None:
    """Interpreter exit: stop every thread and wait for them, `EXIT_WAIT` seconds in all."""
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
    """Wait, up to ``timeout`` seconds in all, for stopped threads to end, warning when that
    takes longer than a moment (a thread stuck in a blocked item).

    A new DataLoader iterator with workers forks processes; a thread still running at a fork
    (one an earlier, dropped iterator asked to stop) may hold a lock the child then finds held
    forever: one inside your dataset's code, say. Leaving an iterator never waits, so a new one
    waits here instead, and so does ``close()`` on a loader.

    Returns:
        Whether every stopped thread has ended.
    """
    deadline = time.monotonic() + timeout
    waiting = [p for p in list(_stopping) if p is not threading.current_thread()]
    quiet_until = time.monotonic() + min(_engine.WARN_AFTER, timeout)
    for producer in waiting:
        producer.join(max(0.0, quiet_until - time.monotonic()))
    stuck = [p for p in waiting if p.is_alive()]
    if stuck:
        warnings.warn(
            f"prefetchx: waiting up to {timeout:g} s for {len(stuck)} stopped thread(s) of "
            f"dropped iterators to return from a call of their source: "
            + ", ".join(f"{p.name!r} in {p.source_name}" for p in stuck)
            + " (a blocked dataset or worker?).",
            RuntimeWarning,
            stacklevel=3,
        )
        for producer in stuck:
            producer.join(max(0.0, deadline - time.monotonic()))
    if not any(p.is_alive() for p in waiting):
        REAPER.idle(max(0.0, deadline - time.monotonic()))  # it ends once they have
    return not any(p.is_alive() for p in waiting)
