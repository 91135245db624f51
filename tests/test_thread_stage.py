"""The thread stage on its own: the same outcomes as calling the source, lifecycle, memory."""

from __future__ import annotations

import _thread
import gc
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from prefetchx import EpochStats, ThreadStage, _engine
from prefetchx._adapt import (
    CLEAR_GROWTH,
    PEEK,
    PROBE_BUDGET,
    SETTLE,
    SETTLE_INLINE,
    WINDOW,
    Chooser,
    Memory,
)
from prefetchx._engine import Channel, Failure, Signal
from prefetchx._producer import MAX_PATIENCE
from prefetchx._thread_stage import COARSE_SPAN_S, COARSE_WINDOW, coarse_window
from tests.helpers import Switching, ThreadGate, wait_until


class Abort(BaseException):
    """A BaseException that is not an Exception, as prefetch_generator lets slip."""


def _gen(n: int, *, fail: BaseException | None = None) -> Iterator[object]:
    yield from range(n)
    if fail is not None:
        raise fail


class Flaky:
    """An iterator of ``range(n)`` whose calls at ``fail_at`` raise instead and go on after, as a
    DataLoader iterator does when one batch fails; it can warn at ``warn_at``."""

    def __init__(
        self,
        n: int,
        fail_at: dict[int, BaseException] | None = None,
        warn_at: set[int] | None = None,
    ) -> None:
        self.n = n
        self.fail_at = fail_at or {}
        self.warn_at = warn_at or set()
        self.i = 0
        self.threads: list[str] = []

    def __iter__(self) -> Flaky:
        return self

    def __next__(self) -> int:
        i = self.i
        if i >= self.n:
            raise StopIteration
        self.i += 1
        self.threads.append(threading.current_thread().name)
        if i in self.warn_at:
            warnings.warn(f"item {i} is odd", UserWarning, stacklevel=1)
        if i in self.fail_at:
            raise self.fail_at[i]
        return i


def outcomes(
    iterator: Iterator[Any], n: int | None = None, between: Callable[[], object] = lambda: None
) -> list[Any]:
    """Every outcome of ``next()`` until StopIteration, or the first ``n``: items, and
    ``(type, args)`` of errors, each with the warnings shown during that very call (filters
    stay the same throughout); ``between`` runs after each, as a loop's step."""
    out: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while n is None or len(out) < n:
            seen = len(caught)
            try:
                value: Any = next(iterator)
            except StopIteration:
                break
            except BaseException as exc:
                value = (type(exc).__name__, exc.args)
            out.append((value, [str(w.message) for w in caught[seen:]]))
            between()
    return out


# --- the same outcomes as the source itself ------------------------------------------------------


def _flaky() -> Flaky:
    return Flaky(
        40,
        fail_at={3: ValueError("three"), 4: KeyError("four"), 17: Abort("x"), 30: SystemExit(3)},
        warn_at={0, 5, 17, 39},
    )


@pytest.mark.parametrize("max_prefetch", [0, 1, 3])
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.adaptive
def test_same_outcomes_as_calling_the_source(max_prefetch: int, adaptive: bool) -> None:
    expected = outcomes(_flaky())
    assert len(expected) == 40
    with ThreadStage(_flaky(), max_prefetch, adaptive=adaptive) as stage:
        assert outcomes(stage) == expected
        with pytest.raises(StopIteration):  # and it stays ended
            next(stage)


def test_keyboard_interrupt_from_the_source_is_an_outcome_too() -> None:
    source = Flaky(6, fail_at={2: KeyboardInterrupt()})
    expected = outcomes(Flaky(6, fail_at={2: KeyboardInterrupt()}))
    assert outcomes(ThreadStage(source, max_prefetch=2)) == expected


def test_yields_every_item_in_order_including_none() -> None:
    items = [None, 0, None, "x", None]
    with ThreadStage(iter(items), max_prefetch=2) as stage:
        assert list(stage) == items


def test_empty_source_ends_at_once() -> None:
    stage = ThreadStage(iter([]), max_prefetch=3)
    with pytest.raises(StopIteration):
        next(stage)
    with pytest.raises(StopIteration):
        next(stage)
    assert stage.thread is None


@pytest.mark.parametrize("max_prefetch", [0, 1, 2, 8])
def test_same_items_for_any_depth(max_prefetch: int) -> None:
    assert list(ThreadStage(_gen(50), max_prefetch)) == list(range(50))


@pytest.mark.parametrize("error", [ValueError("bad item"), Abort("stop now"), SystemExit(3)])
def test_failure_keeps_its_type_object_and_traceback(error: BaseException) -> None:
    stage = ThreadStage(_gen(2, fail=error), max_prefetch=2)
    assert next(stage) == 0
    assert next(stage) == 1
    with pytest.raises(type(error)) as info:
        next(stage)
    assert info.value is error
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "_gen" in frames, frames  # the producer's frame where it was raised
    # A generator that raised is finished: its next call ends, and so does the stage.
    with pytest.raises(StopIteration):
        next(stage)
    assert wait_until(lambda: not stage.producer_alive)


# --- when things run -----------------------------------------------------------------------------


def test_nothing_runs_before_the_first_next_which_the_caller_makes() -> None:
    source = Flaky(5)
    stage = ThreadStage(source, max_prefetch=2, steal=False)  # so the thread makes the rest
    time.sleep(0.05)
    assert source.i == 0
    assert stage.thread is None
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]
    assert next(stage) == 0
    assert source.threads[0] == threading.current_thread().name
    thread = stage.thread
    assert thread is not None
    assert thread.name == "prefetchx-thread"
    assert thread.daemon
    assert list(stage) == [1, 2, 3, 4]
    assert set(source.threads[1:]) == {"prefetchx-thread"}
    assert wait_until(lambda: not stage.producer_alive)


def test_max_prefetch_zero_runs_no_thread() -> None:
    source = Flaky(3)
    stage = ThreadStage(source, max_prefetch=0)
    assert list(stage) == [0, 1, 2]
    assert source.threads == [threading.current_thread().name] * 3
    assert stage.thread is None


# --- leaving -------------------------------------------------------------------------------------


def test_close_is_idempotent_and_ends_iteration() -> None:
    stage = ThreadStage(_gen(100), max_prefetch=2)
    assert next(stage) == 0
    stage.close()
    stage.close()
    assert not stage.producer_alive
    with pytest.raises(StopIteration):
        next(stage)


def test_context_manager_stops_the_thread() -> None:
    with ThreadStage(_gen(100), max_prefetch=2) as stage:
        assert next(stage) == 0
    assert not stage.producer_alive


def test_dropped_handle_stops_the_thread_and_releases_the_source() -> None:
    released = threading.Event()

    def source() -> Iterator[int]:
        try:
            yield from range(10**6)
        finally:
            released.set()

    stage = ThreadStage(source(), max_prefetch=2)
    assert next(stage) == 0
    del stage
    gc.collect()
    assert wait_until(lambda: not any(t.name == "prefetchx-thread" for t in threading.enumerate()))
    assert released.wait(10), "the source generator was not closed when the thread ended"


class Gate:
    """A source whose item ``block_at`` waits for ``gate`` (set by the test) before returning."""

    def __init__(self, n: int, block_at: int) -> None:
        self.items = iter(range(n))
        self.block_at = block_at
        self.gate = threading.Event()
        self.reached = threading.Event()

    def __iter__(self) -> Gate:
        return self

    def __next__(self) -> int:
        item = next(self.items)
        if item == self.block_at:
            self.reached.set()
            self.gate.wait(30)
        return item


def test_dropping_never_waits_for_the_item_the_thread_is_making() -> None:
    source = Gate(10, block_at=1)
    stage = ThreadStage(source, max_prefetch=2)
    assert next(stage) == 0
    assert source.reached.wait(10)
    thread = stage.thread
    start = time.monotonic()
    del stage  # the last reference: the finalizer runs here
    assert time.monotonic() - start < 5.0  # far below the 30 s the thread is inside for
    assert thread is not None
    assert thread.is_alive()
    source.gate.set()
    assert wait_until(lambda: not thread.is_alive())


def test_close_waits_bounded_and_says_whether_the_thread_is_still_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_engine, "JOIN_TIMEOUT", 0.2)
    source = Gate(10, block_at=1)
    stage = ThreadStage(source, max_prefetch=2)
    assert next(stage) == 0
    assert source.reached.wait(10)
    start = time.monotonic()
    stage.close()
    assert 0.15 < time.monotonic() - start < 5
    assert stage.producer_alive
    source.gate.set()
    assert wait_until(lambda: not stage.producer_alive)
    with pytest.raises(StopIteration):
        next(stage)


def test_ctrl_c_while_waiting_is_raised_and_loses_nothing() -> None:
    source = Gate(6, block_at=1)
    stage = ThreadStage(source, max_prefetch=2)
    assert next(stage) == 0
    assert source.reached.wait(10)
    # Ctrl-C reaches the main thread while it waits for item 1.
    timer = threading.Timer(0.2, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(stage)
    finally:
        timer.join()
    assert stage.producer_alive  # not stopped: the loop may catch Ctrl-C and go on
    source.gate.set()
    assert list(stage) == [1, 2, 3, 4, 5]


def test_queue_holds_at_most_max_prefetch_items() -> None:
    produced = 0

    def source() -> Iterator[int]:
        nonlocal produced
        for i in range(1000):
            produced += 1
            yield i

    with ThreadStage(source(), max_prefetch=3) as stage:
        assert next(stage) == 0
        # 1 consumed + 3 queued + 1 in the producer's hand, blocked on the full queue.
        assert wait_until(lambda: produced == 5)
        threading.Event().wait(0.3)
        assert produced == 5


@pytest.mark.parametrize(
    ("value", "exc"), [(-1, ValueError), (1.5, TypeError), ("2", TypeError), (True, TypeError)]
)
def test_bad_max_prefetch_is_refused(value: object, exc: type[Exception]) -> None:
    with pytest.raises(
        exc,
        match=rf"`max_prefetch`.*{value!r}"
        if exc is TypeError
        else r"`max_prefetch` must be >= 0, got -1",
    ):
        ThreadStage(iter([]), max_prefetch=value)  # type: ignore[arg-type]


def test_a_channel_reports_a_producer_that_died_silently() -> None:
    q = Channel(1)
    dead = threading.Thread(target=lambda: None, name="prefetchx-test-dead")
    dead.start()
    dead.join()
    value = q.get(dead, threading.Event())
    assert isinstance(value, Failure)
    assert isinstance(value.exc, RuntimeError)
    assert "prefetchx-test-dead" in str(value.exc)


def test_a_producer_waiting_for_room_goes_on_as_soon_as_one_item_is_taken() -> None:
    q, stop = Channel(5), threading.Event()

    def produce() -> None:
        for i in range(6):
            assert q.room(stop)  # asked before each item is made, never with one in hand
            q.put(i)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        assert wait_until(lambda: q.producer_waits)
        assert q.full()
        assert q.qsize() == 5
        assert q.get(producer, stop) == 0  # 4 left: room for one, and the producer makes it
        producer.join(10)
        assert not producer.is_alive()
    finally:
        stop.set()  # a producer still waiting ends
    assert not q.producer_waits
    assert q.qsize() == 5
    assert [q.get(producer, stop) for _ in range(5)] == [1, 2, 3, 4, 5]


# --- warnings ------------------------------------------------------------------------------------


def test_warnings_from_the_thread_come_with_their_item_in_the_callers_thread() -> None:
    source = Flaky(8, warn_at={3, 6})
    stage = ThreadStage(source, max_prefetch=8)
    assert next(stage) == 0
    assert wait_until(lambda: source.i == 8)  # the thread has made (and warned for) them all
    got = outcomes(stage)
    assert got == [(i, [f"item {i} is odd"] if i in (3, 6) else []) for i in range(1, 8)]
    assert set(source.threads[1:]) == {"prefetchx-thread"}


def _errors_and_items(stage: Iterator[Any]) -> list[Any]:
    out: list[Any] = []
    while True:
        try:
            out.append(next(stage))
        except StopIteration:
            return out
        except UserWarning as warning:
            out.append(str(warning))


def test_a_warning_turned_error_where_it_is_raised_is_that_items_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _errors_and_items(ThreadStage(Flaky(4, warn_at={2}), max_prefetch=2))
    assert got == [0, 1, "item 2 is odd", 3]


def test_the_callers_filters_when_it_receives_the_item_decide_too() -> None:
    source = Flaky(6, warn_at={2, 4})
    stage = ThreadStage(source, max_prefetch=8)
    assert next(stage) == 0
    assert wait_until(lambda: source.i == 6)  # both warnings raised in the thread already
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        assert next(stage) == 1
        assert next(stage) == 2  # ignored now, as DataLoader's next() would have ignored it
        warnings.simplefilter("error")
        assert next(stage) == 3
        with pytest.raises(UserWarning, match="item 4 is odd"):
            next(stage)  # raised from this next(), as DataLoader would raise it here
        assert next(stage) == 5
    assert caught == []


# --- who makes the items: the thread or the caller -----------------------------------------------


class Paced:
    """``range(n)``, each item taking ``seconds`` to make in the caller's thread and
    ``seconds * slower_in_a_thread`` in any other (a thread that costs the machine more than it
    hides, as on oversubscribed cores), recording who made it. With ``slower_until``, the items
    from that one on take as long in any thread."""

    def __init__(
        self,
        n: int,
        seconds: float,
        slower_in_a_thread: float = 1.0,
        slower_until: int | None = None,
    ) -> None:
        self.source = Flaky(n)
        self.seconds = seconds
        self.slower = slower_in_a_thread
        self.until = n if slower_until is None else slower_until
        self.main = threading.current_thread()

    @property
    def threads(self) -> list[str]:
        return self.source.threads

    def __iter__(self) -> Paced:
        return self

    def __next__(self) -> int:
        here = threading.current_thread() is self.main or self.source.i >= self.until
        time.sleep(self.seconds if here else self.seconds * self.slower)
        return next(self.source)


def _made_by_thread(threads: list[str]) -> int:
    return sum(1 for name in threads if name == "prefetchx-thread")


# The next two run on `_Clock`: on a loaded machine a preemption inside the loop would be a
# step of milliseconds, and a thread worth a look.
@pytest.mark.adaptive
def test_a_loop_with_no_work_never_starts_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    stage, got, _ = _fast_loop(monkeypatch, 300, lambda i: 0.0, lambda i: 0.0, max_prefetch=4)
    assert [value for value, _ in got] == list(range(300))
    assert stage.thread is None
    assert stage.stats.inline_batches == 300


@pytest.mark.adaptive
def test_nothing_to_hide_in_the_step_never_starts_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slow items, but a step of no work: a thread could hide nothing behind it.
    stage, got, _ = _fast_loop(monkeypatch, 60, lambda i: 1e-3, lambda i: 0.0)
    assert [value for value, _ in got] == list(range(60))
    assert stage.thread is None


@pytest.mark.adaptive
def test_a_thread_that_hides_the_data_takes_over_without_losing_an_item() -> None:
    source = Paced(120, 0.002)
    stage = ThreadStage(source, max_prefetch=2)
    got = []
    for item in stage:
        got.append(item)
        _ = stage.stats.wait.total  # reading the meter (folding it) changes nothing
        time.sleep(0.002)
    assert got == list(range(120))
    me = threading.current_thread().name
    assert source.threads[:5] == [me] * 5  # the first item, then a first window inline
    assert _made_by_thread(source.threads) > 80
    assert source.threads[-1] == "prefetchx-thread"


@pytest.mark.adaptive
def test_a_thread_that_slows_the_loop_is_sent_back() -> None:
    # Made in the thread, an item takes 4x as long: the caller makes them faster itself.
    source = Paced(160, 0.001, slower_in_a_thread=4.0)
    memory = Memory()
    stage = ThreadStage(source, max_prefetch=2, _memory=memory)
    for _ in stage:
        time.sleep(0.001)
    assert stage.thread is not None  # it was tried
    me = threading.current_thread().name
    assert source.threads[-1] == me
    assert source.threads.count(me) > 110
    assert memory.threaded is False
    assert memory.backoff >= CLEAR_GROWTH  # and will be tried less often


@pytest.mark.adaptive
def test_the_choice_follows_the_loop_as_it_changes() -> None:
    # First a step of no work and items a thread makes 4x slower: the loop keeps making them,
    # even if a loaded machine's preemptions make a window's steps look worth a probe (with
    # equal costs, a probe could win on noise). Then a step as long as an item, now as quick
    # to make in any thread: the thread halves the loop's time (under 6 CPU burners on 2 cores
    # it still lost once in 30 runs: its GIL hand-offs cost milliseconds there).
    source = Paced(300, 0.005, slower_in_a_thread=4.0, slower_until=100)
    stage = ThreadStage(source, max_prefetch=2)
    for i in stage:
        if i >= 100:
            time.sleep(0.005)
    assert _made_by_thread(source.threads[:100]) < 30
    assert _made_by_thread(source.threads[150:]) > 100


@pytest.mark.adaptive
def test_the_next_epoch_starts_with_what_the_last_one_found() -> None:
    memory = Memory()
    first = Paced(80, 0.002)
    for _ in ThreadStage(first, max_prefetch=2, _memory=memory):
        time.sleep(0.002)
    assert memory.threaded is True
    second = Paced(10, 0.002)
    stage = ThreadStage(second, max_prefetch=2, _memory=memory)
    assert next(stage) == 0
    assert stage.thread is not None  # at once, after the caller's first item
    assert list(stage) == list(range(1, 10))


@pytest.mark.adaptive
@pytest.mark.parametrize(("slower", "threaded"), [(1.0, True), (4.0, False)])
def test_epochs_shorter_than_a_window_still_decide(slower: float, threaded: bool) -> None:
    # 12 items an epoch, fewer than a probe takes (4 settling, 16 measured): each window ends
    # with the epoch at the latest, and a probe the end cuts short is decided on what it has.
    memory = Memory()
    tried = []  # the epochs in which the thread made items
    for _ in range(10):
        source = Paced(12, 0.002, slower_in_a_thread=slower)
        for _ in ThreadStage(source, max_prefetch=2, limit=12, _memory=memory):
            time.sleep(0.002)
        tried.append(_made_by_thread(source.threads) > 0)
    assert memory.threaded is threaded
    # The first epoch sets the loop alone's figure after its first batches; the second tells
    # how its windows stray. The probe due as it ends is put off to after the next epoch's
    # first window, which ends that epoch too: the thread first runs in the fourth.
    assert tried.index(True) == 3
    if not threaded:
        # 8 ms a batch with the thread against 4 ms without: a probe of 8 batches costs 8
        # batches' time, so the next waits about 50 windows (half of it allows for timing).
        assert memory.backoff >= (SETTLE + PEEK) / (PROBE_BUDGET * WINDOW) / 2


@pytest.mark.parametrize("max_prefetch", [1, 2, 5])
@pytest.mark.parametrize("steal", [False, True])
def test_switching_every_other_item_loses_and_reorders_nothing(
    max_prefetch: int, steal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", Switching)
    expected = outcomes(_flaky())
    source = _flaky()
    with ThreadStage(source, max_prefetch, steal=steal) as stage:
        assert outcomes(stage) == expected
        assert stage._chooser is not None
        switches = stage._chooser.switches
    assert switches > 8  # with steal too: the caller takes the source back without the thread
    if not steal:
        me = threading.current_thread().name
        assert 5 < source.threads.count(me) < 35  # both made items


def _then_inline(threaded_items: int) -> type[Chooser]:
    """A chooser that runs the thread for ``threaded_items`` items after the first, then
    makes the items inline for good."""

    class ThenInline(Chooser):
        def start(self) -> tuple[bool, int]:
            self.threaded = True
            return True, threaded_items

        def window(self, period: float, means: Any, ending: bool = False) -> tuple[bool, int]:
            self.threaded = False
            return False, 16

    return ThenInline


def test_close_while_inline_stops_the_parked_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _then_inline(4))
    stage = ThreadStage(_gen(10**6), max_prefetch=2)
    for _ in range(100):
        next(stage)
    assert stage.stats.inline_batches > 80
    assert stage.producer_alive  # parked, not gone
    stage.close()
    assert not stage.producer_alive


class _Counting(Chooser):
    """Threaded for the 4 items after the first, then inline for good; counts its windows."""

    windows = 0

    def start(self) -> tuple[bool, int]:
        self.threaded = True
        return True, 4

    def window(self, period: float, means: Any, ending: bool = False) -> tuple[bool, int]:
        type(self).windows += 1
        self.threaded = False
        return False, 4


@pytest.mark.parametrize("steal", [False, True])
def test_the_caller_takes_the_source_back_from_a_thread_that_cannot_run(
    steal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loop that holds the GIL can keep the thread from running for the rest of an epoch. The
    # caller then goes on alone at once, and the choice goes on being made, rather than wait
    # for the thread to park (before: it waited, and no window after the switch was measured).
    # Without steal, the caller waits for the thread's first items, so the thread can run, and
    # the case checks the order where both ways of handing the source back can happen.
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _Counting)
    monkeypatch.setattr(_Counting, "windows", 0)
    monkeypatch.setattr("prefetchx._producer.PARK_WAIT", 0.0)
    gate = ThreadGate(monkeypatch)  # the thread cannot make an item
    source = Flaky(60, fail_at={9: ValueError("nine")}, warn_at={12})
    stage = ThreadStage(source, max_prefetch=2, steal=steal)
    if not steal:
        threading.Timer(0.2, gate.open.set).start()  # it waits for the thread's first items
    got = outcomes(stage, 40)
    assert _Counting.windows >= 8  # one every 4 items after the switch
    gate.open.set()
    got += outcomes(stage)
    assert got == outcomes(Flaky(60, fail_at={9: ValueError("nine")}, warn_at={12}))
    made_by_thread = source.threads.count("prefetchx-thread")
    if steal:
        assert made_by_thread == 0
    else:  # its first 4, and at most as many ahead as its queue holds; nothing after that
        assert 4 <= made_by_thread <= 4 + 3
        assert source.threads[1 + made_by_thread :] == ["MainThread"] * (59 - made_by_thread)
    assert wait_until(lambda: not stage.producer_alive)


class _BackToTheCaller(Chooser):
    """Threaded for 8 items after the first, then back to the caller with the real chooser's
    settling window, then its first measured one; notes, at each window's end, how many items
    the loop had and how many the source had made, in all and in the loop's thread."""

    source: Flaky
    taken = 0
    ends: list[tuple[int, int, int]]

    def start(self) -> tuple[bool, int]:
        self.threaded = True
        return True, 8

    def window(self, period: float, means: Any, ending: bool = False) -> tuple[bool, int]:
        threads = type(self).source.threads
        ends = type(self).ends
        ends.append((type(self).taken, len(threads), threads.count("MainThread")))
        self.threaded = False
        return False, (SETTLE_INLINE if len(ends) == 1 else PEEK)


def test_back_to_the_caller_only_its_own_items_are_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The items the thread had queued come quick: counted in the measured window, they would
    # flatter the mode just left. The settling window goes on until the loop has taken them
    # all, then ends with the first item the loop made itself, not later.
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _BackToTheCaller)
    source = Flaky(40)
    monkeypatch.setattr(_BackToTheCaller, "source", source, raising=False)
    monkeypatch.setattr(_BackToTheCaller, "ends", [], raising=False)
    with ThreadStage(source, max_prefetch=4) as stage:
        for taken in range(1, 25):
            _BackToTheCaller.taken = taken
            next(stage)
            if taken < 9:  # a step long enough for the thread to fill its queue
                assert wait_until(lambda: len(source.threads) >= taken + 2)  # noqa: B023
    (_, _, before), (taken, made, own), (_, _, measured) = _BackToTheCaller.ends[:3]
    assert taken == made  # nothing queued ahead is left: the loop took it all
    assert taken > 1 + 8 + 1  # the queue held items when the switch came
    assert own == before + SETTLE_INLINE  # then the settling window ends
    assert measured == own + PEEK  # the measured window: the loop's own items only


def test_a_thread_the_source_was_taken_back_from_is_parked_before_the_caller_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread left trying for the GIL would slow each of the caller's batches: the caller lets
    # go of the GIL until it has parked.
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _Counting)
    monkeypatch.setattr("prefetchx._producer.PARK_WAIT", 30.0)
    gate = ThreadGate(monkeypatch)
    source = Flaky(100)
    stage = ThreadStage(source, max_prefetch=2)
    assert [next(stage) for _ in range(5)] == list(range(5))  # made by the caller: held thread
    producer = _started(stage)
    threading.Timer(0.2, gate.open.set).start()
    assert next(stage) == 5  # the switch: taken back, and the thread let in to park
    assert producer.parked.is_set()
    assert list(stage) == list(range(6, 100))
    assert source.threads == ["MainThread"] * 100


def test_ctrl_c_while_the_thread_is_let_in_to_park_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _Counting)
    monkeypatch.setattr("prefetchx._producer.PARK_WAIT", 30.0)
    gate = ThreadGate(monkeypatch)  # the thread cannot park until the gate opens
    stage = ThreadStage(iter(range(100)), max_prefetch=2)
    assert [next(stage) for _ in range(5)] == list(range(5))
    # A real SIGINT: `_thread.interrupt_main` would not end a wait on a lock until it times out.
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(stage)  # the switch: the source is taken back, then the wait is interrupted
    finally:
        timer.join()
    gate.open.set()
    # Before the wait, the stage had switched: it does not wait for a PAUSED that never comes.
    assert list(stage) == list(range(5, 100))


def test_adaptive_off_keeps_the_thread() -> None:
    source = Flaky(100)
    assert list(ThreadStage(source, 2, adaptive=False, steal=False)) == list(range(100))
    assert set(source.threads[1:]) == {"prefetchx-thread"}


# --- the caller makes what the thread has not started (steal) ------------------------------------


def _gated_flaky() -> Flaky:
    return Flaky(12, fail_at={4: ValueError("four")}, warn_at={3, 9})


def _started(stage: ThreadStage[Any]) -> Any:
    """The stage's producer thread, started by a first ``next()``."""
    assert stage._producer is not None
    return stage._producer


def _held(monkeypatch: pytest.MonkeyPatch) -> tuple[ThreadGate, ThreadStage[int], Any]:
    """A stage over ``range(100)`` past its first item, its thread held at a gate."""
    gate = ThreadGate(monkeypatch)
    stage = ThreadStage(iter(range(100)), max_prefetch=2, adaptive=False)
    assert next(stage) == 0
    return gate, stage, _started(stage)


def test_the_caller_makes_the_items_the_thread_has_not_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = ThreadGate(monkeypatch)
    source = _gated_flaky()
    stage = ThreadStage(source, max_prefetch=2, adaptive=False)
    got = outcomes(stage, 6)  # the thread is held before its first call: the caller makes these
    assert source.threads == ["MainThread"] * 6
    gate.open.set()
    assert wait_until(_started(stage).queue.full)  # now the thread runs ahead, after them
    got += outcomes(stage)
    assert got == outcomes(_gated_flaky())  # the same items, errors and warnings, in order
    assert source.threads[6:9] == ["prefetchx-thread"] * 3
    assert wait_until(lambda: not stage.producer_alive)


def test_without_steal_the_caller_waits_for_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = ThreadGate(monkeypatch)
    source = _gated_flaky()
    stage = ThreadStage(source, max_prefetch=2, adaptive=False, steal=False)
    assert next(stage) == 0
    threading.Timer(0.1, gate.open.set).start()
    assert outcomes(stage) == outcomes(_gated_flaky())[1:]
    assert source.threads == ["MainThread"] + ["prefetchx-thread"] * 11


class _Jittery(Flaky):
    """`Flaky` whose calls now and then take half a millisecond."""

    def __init__(self, seed: int) -> None:
        super().__init__(
            1500,
            fail_at={i: ValueError(i) for i in range(7, 1500, 97)},
            warn_at=set(range(11, 1500, 113)),
        )
        self.jitter = random.Random(seed)

    def __next__(self) -> int:
        if self.jitter.random() < 0.05:
            time.sleep(0.0005)
        return super().__next__()


@pytest.mark.parametrize("seed", range(3))
def test_the_caller_and_the_thread_taking_turns_keep_every_outcome_in_order(seed: int) -> None:
    # Both make items, in whatever turns the scheduler gives them: the outcomes stay those of
    # the source called alone.
    steps = random.Random(seed)

    def step() -> None:
        if steps.random() < 0.2:
            time.sleep(0.0005)  # now and then, a step long enough for the thread to get in

    source = _Jittery(seed)
    got = outcomes(ThreadStage(source, max_prefetch=2, adaptive=False), between=step)
    assert got == outcomes(_Jittery(seed))
    assert set(source.threads[1:]) == {"MainThread", "prefetchx-thread"}


def test_a_thread_that_found_the_caller_making_items_is_woken_ever_less_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A loop the thread cannot help (a fast source, no step) would otherwise pay a wake-up and
    # a GIL hand-off for every item.
    gate, stage, producer = _held(monkeypatch)
    # As if the thread had backed off three times in a row (it is held at the gate meanwhile).
    producer.retreated, producer.patience = True, 8
    wakes = []
    wake = Channel.wake_producer
    monkeypatch.setattr(Channel, "wake_producer", lambda q: wakes.append(1) or wake(q))
    assert [next(stage) for _ in range(16)] == list(range(1, 17))
    assert len(wakes) == 2  # after the 8th item the caller made, and the 16th
    producer.retreated = False
    assert [next(stage) for _ in range(8)] == list(range(17, 25))
    assert len(wakes) == 2  # a thread that has not backed off is not woken
    gate.open.set()
    assert list(stage) == list(range(25, 100))


def test_back_off_doubles_up_to_a_cap_and_starts_over_once_the_thread_has_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate, stage, producer = _held(monkeypatch)
    patience = []
    for _ in range(9):
        producer.queue.wake_producer()  # so that the nap returns at once
        producer._back_off()
        patience.append(producer.patience)
    assert patience == [2, 4, 8, 16, 32, 64, 64, 64, 64]
    assert MAX_PATIENCE == 64
    gate.open.set()
    assert wait_until(producer.queue.full)  # the thread had the source
    assert producer.patience == 1
    assert not producer.backed_off
    assert list(stage) == list(range(1, 100))


def test_close_wakes_a_thread_that_backed_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "POLL_INTERVAL", 60.0)  # only a wake-up ends its nap in time
    gate, stage, producer = _held(monkeypatch)
    with producer.source_lock:  # as a caller making an item itself
        gate.open.set()
        assert wait_until(lambda: producer.backed_off)
    stage.close()
    assert not stage.producer_alive


# --- the stall meter -----------------------------------------------------------------------------


def _slow(n: int, seconds: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_stats_of_a_compute_bound_loop() -> None:
    stage = ThreadStage(_gen(10), max_prefetch=2)
    next(stage)
    # Let the thread fill the queue, so the loop should hardly wait at all.
    assert wait_until(lambda: stage._producer is not None and stage._producer.queue.full())
    for _ in stage:
        time.sleep(0.03)
    stats = stage.stats
    assert stats.batches == 10
    assert stats.step.percentile(50) >= 0.029
    # Loose: a VM can stall one get for tens of milliseconds; the verdict's own threshold is
    # tested on fixed numbers below.
    assert stats.input_bound_fraction < 0.3, str(stats)
    assert stats.occupancy.mean >= 1.0
    row = stats.as_dict()
    assert row["batches"] == 10
    assert row["step_p95_s"] >= 0.029


def test_verdict_and_percentiles_on_fixed_numbers() -> None:
    stats = EpochStats()
    stats.warmup_s = 0.5
    stats.wait.add(0.5)  # the first batch: worker start-up, left out of the verdict
    for wait in [0.001] * 19 + [0.020]:
        stats.wait.add(wait)
        stats.step.add(0.1)
    assert stats.batches == 21
    assert stats.wait.percentile(50) == 0.001
    assert stats.wait.percentile(100) == 0.5
    assert stats.wait.total == pytest.approx(0.539)
    assert stats.input_bound_fraction == pytest.approx(0.039 / 2.039)
    assert stats.verdict() == "compute-bound: data loading is hidden (1.9% of the time waiting)"
    stats.wait.add(1.0)
    assert stats.verdict().startswith("input-bound 34% of the time")  # 1.039 of 3.039 s
    assert EpochStats().verdict() == "no batches yet"


def test_with_gpu_samples_the_verdict_goes_by_the_gpus_idle_time() -> None:
    # The loop waits 40 ms per batch in next() while the GPU, still busy with the steps it
    # queued, sits idle 1 ms per batch: compute-bound, whatever the loop's own waits say.
    stats = EpochStats()
    stats.warmup_s = 0.5
    stats.wait.add(0.5)
    for _ in range(10):
        stats.wait.add(0.040)
        stats.step.add(0.060)
        stats.gpu_idle.add(0.001)
    assert stats.input_bound_fraction == pytest.approx(0.4)
    assert stats.gpu_idle_fraction == pytest.approx(0.01)
    assert stats.verdict() == "compute-bound: the GPU waited for data 1.0% of the time"
    for _ in range(10):
        stats.gpu_idle.add(0.041)
    assert stats.gpu_idle_fraction == pytest.approx(0.21)  # 21 ms of a 100 ms loop
    assert stats.verdict().startswith("input-bound: the GPU waited for data 21% of the time")
    row = stats.as_dict()
    assert row["gpu_idle_total_s"] == pytest.approx(0.42)
    assert row["gpu_idle_mean_s"] == pytest.approx(0.021)


def _batch(stats: EpochStats, step: float | None, *, threaded: bool) -> None:
    """Record one batch as a stage does: the step before it, then, if taken from the thread's
    queue, an occupancy sample, then the wait."""
    if step is not None:
        stats.step.add(step)
    if threaded:
        stats.occupancy.add(1)
    stats.wait.add(0.0001)


def test_the_verdict_says_what_the_thread_costs_the_step() -> None:
    # 20 steps of 66 us beside the thread, then 20 of 25 us with it parked: the thread's share
    # of the GIL slows the step by 164%, which the loop's waits cannot show.
    stats = EpochStats()
    stats.warmup_s = 0.0001
    _batch(stats, None, threaded=False)  # the first batch, made in the loop's thread
    for _ in range(20):
        _batch(stats, 66e-6, threaded=True)
    for _ in range(20):
        _batch(stats, 25e-6, threaded=False)
    stats.step.add(1.0)  # the step after the last batch: the loop asks once more, and it ends
    assert stats.step_threaded.count == 20
    assert stats.step_threaded.mean == pytest.approx(66e-6)
    assert stats.step_inline_mean == pytest.approx(25e-6)  # the step after the end left out
    assert stats.thread_step_cost == pytest.approx(66 / 25 - 1)
    assert stats.verdict().endswith(
        "; but the thread slows the step by 164% (66 us a step with it running, 25 us "
        "without): try max_prefetch=0"
    ), stats.verdict()
    row = stats.as_dict()
    assert row["step_threaded_mean_s"] == pytest.approx(66e-6)
    assert row["step_inline_mean_s"] == pytest.approx(25e-6)
    assert row["thread_step_cost"] == pytest.approx(1.64)


def test_the_verdict_says_when_the_thread_does_not_slow_the_step() -> None:
    stats = EpochStats()
    stats.warmup_s = 0.0001
    _batch(stats, None, threaded=False)
    for step in [0.0102, 0.0098] * 5:
        _batch(stats, step, threaded=True)
    for _ in range(10):
        _batch(stats, 0.0101, threaded=False)
    assert stats.thread_step_cost == pytest.approx(0.0100 / 0.0101 - 1)  # -1%
    assert stats.verdict() == (
        "compute-bound: data loading is hidden (1.0% of the time waiting); the thread does "
        "not slow the step (10.00 ms a step with it running, 10.10 ms without)"
    )


def test_a_step_never_timed_without_the_thread_is_said_to_be_unknown() -> None:
    # The JPEG pipeline's case: the thread never parks, so the step was never timed alone,
    # and "data loading is hidden" alone would hide what the thread takes from the step.
    stats = EpochStats()
    stats.warmup_s = 0.0001
    _batch(stats, None, threaded=False)
    for _ in range(30):
        _batch(stats, 0.040, threaded=True)
    assert stats.step_threaded.count == 30
    assert math.isnan(stats.step_inline_mean)
    assert math.isnan(stats.thread_step_cost)
    assert stats.verdict().endswith(
        "; the step was not timed without the thread, which may slow it (the GIL and the "
        "cores it takes): compare with max_prefetch=0"
    )
    # Too few steps of one kind to compare: still unknown, not a figure from 3 samples.
    for _ in range(3):
        _batch(stats, 0.010, threaded=False)
    assert stats.step_inline_mean == pytest.approx(0.010)
    assert math.isnan(stats.thread_step_cost)


def test_several_batches_taken_for_one_step_file_it_once() -> None:
    # A device stage takes a batch from the thread and tops up its device queue from it
    # within one step: the step ran beside the thread once.
    stats = EpochStats()
    stats.step.add(0.01)
    stats.occupancy.add(2)
    stats.occupancy.add(1)
    stats.fold()  # a fold in between changes nothing
    stats.occupancy.add(0)
    assert stats.step_threaded.count == 1
    stats.step.add(0.02)
    stats.occupancy.add(1)
    assert stats.step_threaded.total == pytest.approx(0.03)


def test_a_real_epoch_files_its_steps_by_who_made_the_next_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Long steps with the thread on, then steps with it parked: every batch taken from
    # the queue files the step before it as threaded, and the rest are inline.
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _then_inline(39))

    def step_for(i: int) -> None:
        if i < 40:
            time.sleep(0.0005)

    stage = ThreadStage(iter(range(80)), max_prefetch=2)
    for i in stage:
        step_for(i)
    stats = stage.stats
    assert stats.batches == 80
    assert stats.inline_batches > 8, str(stats)  # the thread parked
    assert stats.step_threaded.count == stats.occupancy.count  # one step per threaded batch
    assert stats.step_threaded.mean > 0.0004
    assert stats.step_inline_mean < stats.step_threaded.mean
    assert not math.isnan(stats.thread_step_cost)


def test_one_batch_in_the_verdict_is_warming_up_not_input_bound() -> None:
    stage = ThreadStage(_slow(5, 0.02), max_prefetch=2)
    next(stage)
    assert stage.stats.warmup_s >= 0.015
    assert stage.stats.verdict().startswith("warming up: the first batch took")
    stage.close()


def test_stats_of_an_input_bound_loop() -> None:
    stage = ThreadStage(_slow(6, 0.01), max_prefetch=2)
    for _ in stage:
        pass
    stats = stage.stats
    assert stats.batches == 6
    assert stats.wait.total >= 0.04
    assert stats.produce.mean >= 0.009
    assert stats.verdict().startswith("input-bound")
    assert stats.input_bound_fraction > 0.5


@pytest.mark.parametrize("adaptive", [True, False])
def test_counts_are_never_negative_after_an_epoch_that_ends_threaded(adaptive: bool) -> None:
    stage = ThreadStage(_slow(5, 0.002), max_prefetch=2, adaptive=adaptive)
    assert list(stage) == [0, 1, 2, 3, 4]
    stats = stage.stats
    assert stats.batches == 5
    assert stats.inline_batches == 1  # the first, made by the caller
    assert stats.as_dict()["inline_batches"] == 1


@pytest.mark.parametrize("max_prefetch", [0, 3])
def test_tally_counts_outcomes_handed_over_and_the_natural_end(max_prefetch: int) -> None:
    stage = ThreadStage(Flaky(10, fail_at={5: ValueError("five")}), max_prefetch=max_prefetch)
    for _ in range(4):
        next(stage)
    assert (stage.tally.count, stage.tally.ended) == (4, False)
    got = outcomes(stage)
    assert [value for value, _ in got] == [4, ("ValueError", ("five",)), 6, 7, 8, 9]
    assert (stage.tally.count, stage.tally.ended) == (10, True)
    assert (stage.stats.batches, stage.stats.errors) == (9, 1)


@pytest.mark.parametrize("max_prefetch", [0, 3])
def test_tally_is_not_ended_by_close(max_prefetch: int) -> None:
    stage = ThreadStage(iter(range(10)), max_prefetch=max_prefetch)
    next(stage)
    stage.close()
    assert list(stage) == []
    assert (stage.tally.count, stage.tally.ended) == (1, False)


class _Clock:
    """A stand-in for ``perf_counter`` that moves only when told: a source and a loop whose
    waits and steps take exactly the time given, and a count of the stage's clock reads."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class _Timed(Flaky):
    """`Flaky` whose calls take ``wait(i)`` seconds on ``clock``."""

    def __init__(self, clock: _Clock, n: int, wait: Callable[[int], float], **kw: Any) -> None:
        super().__init__(n, **kw)
        self.clock, self.wait = clock, wait

    def __next__(self) -> int:
        self.clock.now += self.wait(self.i)
        return super().__next__()


def _fast_loop(
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    wait: Callable[[int], float],
    step: Callable[[int], float],
    *,
    timed_only: bool = False,
    max_prefetch: int = 2,
    **kw: Any,
) -> tuple[ThreadStage[int], list[Any], _Clock]:
    """A loop over a `_Timed` source on a `_Clock`, through the stage's outlet as
    `PrefetchIterator` iterates it; ``timed_only`` times every batch."""
    clock = _Clock()
    monkeypatch.setattr("prefetchx._thread_stage.perf_counter", clock)
    if timed_only:
        monkeypatch.setattr("prefetchx._thread_stage.COARSE_BELOW_S", 0.0)
    stage = ThreadStage(_Timed(clock, n, wait, **kw), max_prefetch=max_prefetch)
    got = []
    i = 0

    def between() -> None:
        nonlocal i
        clock.now += step(i)
        i += 1

    got = outcomes(stage.outlet(), between=between)
    return stage, got, clock


@pytest.mark.adaptive
@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_a_loop_too_fast_to_time_each_batch_reads_the_clock_once_a_window(
    monkeypatch: pytest.MonkeyPatch, max_prefetch: int
) -> None:
    n = 3000
    stage, got, clock = _fast_loop(
        monkeypatch, n, lambda i: 2e-6, lambda i: 3e-6, max_prefetch=max_prefetch
    )
    assert [value for value, _ in got] == list(range(n))
    assert stage.thread is None
    assert clock.reads < n // 8  # two a batch if every batch were timed
    # What the meter files, it files for every batch, with the exact totals here.
    stats = stage.stats
    assert (stats.batches, stats.wait.count, stats.step.count) == (n, n, n)
    assert stats.wait.total == pytest.approx(n * 2e-6)
    assert stats.step.total == pytest.approx(n * 3e-6)
    assert stats.step.percentile(50) == pytest.approx(3e-6)


@pytest.mark.adaptive
def test_counted_batches_give_the_meter_what_timing_each_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def wait(i: int) -> float:
        return 4e-6

    def step(i: int) -> float:
        return 1e-6 if i % 2 else 5e-6

    coarse, got, _ = _fast_loop(monkeypatch, 2000, wait, step)
    timed, expected, _ = _fast_loop(monkeypatch, 2000, wait, step, timed_only=True)
    assert got == expected
    ours, theirs = coarse.stats.as_dict(), timed.stats.as_dict()
    for key in ("batches", "errors", "inline_batches", "wait_total_s", "wait_mean_s"):
        assert ours[key] == pytest.approx(theirs[key]), key
    # The steps alternate; counted batches get their mean, so only the sums agree.
    assert ours["step_total_s"] == pytest.approx(theirs["step_total_s"])
    assert ours["step_mean_s"] == pytest.approx(3e-6)
    assert ours["input_bound_fraction"] == pytest.approx(theirs["input_bound_fraction"])


@pytest.mark.adaptive
def test_errors_in_a_loop_too_fast_to_time_are_outcomes_as_from_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fail_at = {700: ValueError("seven hundred"), 701: KeyError("next"), 1500: Abort("x")}
    stage, got, clock = _fast_loop(
        monkeypatch, 2000, lambda i: 1e-6, lambda i: 1e-6, fail_at=dict(fail_at)
    )
    assert got == outcomes(Flaky(2000, fail_at=dict(fail_at)))
    assert clock.reads < 2000 // 8
    assert (stage.stats.batches, stage.stats.errors) == (1997, 3)
    assert (stage.tally.count, stage.tally.ended) == (2000, True)


@pytest.mark.adaptive
def test_a_loop_that_slows_down_is_timed_batch_by_batch_again_within_a_window_of_data_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 5 us of data and a 1 us step, then a 300 us step: the change is seen at the end of the
    # counted window it falls in. That window holds COARSE_SPAN_S of batches at the old pace,
    # so the data work a thread could have hidden meanwhile is at most COARSE_SPAN_S.
    n, change, data = 8000, 4000, 5e-6
    clock = _Clock()
    monkeypatch.setattr("prefetchx._thread_stage.perf_counter", clock)
    stage = ThreadStage(_Timed(clock, n, lambda i: data), max_prefetch=2)
    counting = []
    for i, value in enumerate(stage.outlet()):
        assert value == i
        counting.append(stage.counting)
        clock.now += 1e-6 if i < change else 300e-6
    assert len(counting) == n
    late = [i for i in range(change, n) if counting[i]]
    assert late  # the change fell inside a counted window
    assert len(late) * data <= COARSE_SPAN_S
    assert not any(counting[late[-1] + 1 :])  # every batch timed again after its end
    assert stage.stats.step.last(200) == [pytest.approx(300e-6)] * 200
    assert stage.stats.step.count == n


@pytest.mark.parametrize(
    ("period", "batches"),
    [(0.0, COARSE_WINDOW), (4e-6, COARSE_WINDOW), (50e-6, 400), (199e-6, 100), (2e-3, WINDOW)],
)
def test_a_counted_window_lasts_about_20_ms(period: float, batches: int) -> None:
    assert (COARSE_SPAN_S, COARSE_WINDOW) == (20e-3, 4096)
    assert coarse_window(period) == batches


@pytest.mark.adaptive
@pytest.mark.parametrize(("step", "window"), [(45e-6, 400), (495e-6, 40), (895e-6, 22)])
def test_a_loop_under_1_ms_a_batch_is_counted_with_exact_totals(
    monkeypatch: pytest.MonkeyPatch, step: float, window: int
) -> None:
    # Timing each batch would cost such a loop 1% to 2%, so one in each window of 20 ms is
    # timed; the totals stay those of the loop.
    n = 3000
    stage, got, clock = _fast_loop(monkeypatch, n, lambda i: 5e-6, lambda i: step)
    assert [value for value, _ in got] == list(range(n))
    assert stage.thread is None  # 5 us of data: nothing for a thread to hide
    assert clock.reads < 8 * n // window  # two a batch if every batch were timed
    assert stage._coarse_length == window
    stats = stage.stats
    assert (stats.batches, stats.wait.count, stats.step.count) == (n, n, n)
    assert stats.wait.total == pytest.approx(n * 5e-6)
    assert stats.step.total == pytest.approx(n * step)


@pytest.mark.adaptive
def test_the_chooser_is_told_the_batches_of_a_counted_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The chooser weighs how long the loop stays at a level in batches (see
    # `Chooser._worth_leaving`). Told a window's 16 for each counted window of 400, it took
    # this loop's 3000 batches for 116.
    n = 3000
    clock = _Clock()
    monkeypatch.setattr("prefetchx._thread_stage.perf_counter", clock)
    memory = Memory()
    stage = ThreadStage(_Timed(clock, n, lambda i: 5e-6), max_prefetch=2, _memory=memory)
    for _ in stage.outlet():
        clock.now += 45e-6
    assert stage._coarse_length == 400
    assert n - 2 * 400 <= memory.stayed <= n


@pytest.mark.adaptive
def test_a_loop_of_1_ms_a_batch_or_more_is_timed_batch_by_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 500
    stage, got, clock = _fast_loop(monkeypatch, n, lambda i: 5e-6, lambda i: 1e-3)
    assert [value for value, _ in got] == list(range(n))
    assert stage.thread is None
    assert clock.reads >= 2 * n
    assert stage.stats.step.last(n) == [pytest.approx(1e-3)] * n


def _squares(n: int) -> Iterator[int]:
    yield from (i * i for i in range(n))


@pytest.mark.adaptive
@pytest.mark.parametrize(
    "make",
    [lambda n: map(abs, range(-n + 1, 1)), _squares, lambda n: iter(list(range(n)))],
    ids=["map", "generator", "list"],
)
def test_a_source_of_c_or_generator_code_ends_inside_a_counted_window_exactly(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[int], Iterator[int]]
) -> None:
    # A window calls the source's type's __next__ as next() would; a source with no len()
    # ends inside a window, and the stage ends there, with every outcome and exact counts.
    monkeypatch.setattr("prefetchx._thread_stage.COARSE_BELOW_S", 1.0)
    monkeypatch.setattr("prefetchx._adapt.HIDE_AT_LEAST_S", 1.0)
    n = 1000
    stage = ThreadStage(make(n), max_prefetch=2)
    counting = []
    got = []
    for value in stage.outlet():
        got.append(value)
        counting.append(stage.counting)
    assert got == list(make(n))
    assert sum(counting) > n // 2
    assert (stage.stats.batches, stage.stats.errors, stage.tally.count) == (n, 0, n)
    assert stage._source is None  # ended: released


def _counted_edge(monkeypatch: pytest.MonkeyPatch, wait: float, step: float) -> int:
    """The index of the last batch of the first counted window of a loop as `_fast_loop` runs
    it, with ``wait`` and ``step`` seconds for every batch."""
    clock = _Clock()
    monkeypatch.setattr("prefetchx._thread_stage.perf_counter", clock)
    stage = ThreadStage(_Timed(clock, 5000, lambda i: wait), max_prefetch=2)
    counting = []
    for _ in stage.outlet():
        counting.append(stage.counting)
        clock.now += step
    first = counting.index(True)
    return first + counting[first:].index(False) - 1


@pytest.mark.adaptive
@pytest.mark.parametrize("shift", [-1, 0, 1])
@pytest.mark.parametrize("how", ["ends", "fails"])
def test_a_source_that_ends_or_fails_at_a_counted_windows_last_call_is_counted_exactly(
    monkeypatch: pytest.MonkeyPatch, shift: int, how: str
) -> None:
    # The source's StopIteration at the window's last call and an error there followed by the
    # loop's call past the window both end the window with every call of it made: what tells
    # them apart is whether the loop's call past it reached the window.
    wait, step = 2e-6, 3e-6
    at = _counted_edge(monkeypatch, wait, step) + shift
    n, fail_at = (at, {}) if how == "ends" else (at + 50, {at: ValueError("edge")})
    stage, got, _ = _fast_loop(
        monkeypatch, n, lambda i: wait, lambda i: step, fail_at=dict(fail_at)
    )
    assert got == outcomes(Flaky(n, fail_at=dict(fail_at)))
    errors = len(fail_at)
    assert (stage.stats.batches, stage.stats.errors) == (n - errors, errors)
    assert (stage.tally.count, stage.tally.ended) == (n, True)
    assert stage.stats.wait.count == n
    assert stage._source is None  # ended: released


@pytest.mark.adaptive
@pytest.mark.parametrize("taken", [600, 1000])
def test_counts_of_counted_batches_are_exact_at_any_batch(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    clock = _Clock()
    monkeypatch.setattr("prefetchx._thread_stage.perf_counter", clock)

    def run() -> tuple[ThreadStage[int], Iterator[int]]:
        stage = ThreadStage(_Timed(clock, 2000, lambda i: 1e-6), max_prefetch=2)
        outlet = stage.outlet()
        for i in range(taken):
            assert next(outlet) == i
            clock.now += 1e-6
        assert (stage.tally.count, stage.stats.batches, stage.stats.wait.count) == (taken,) * 3
        return stage, outlet

    coarse, coarse_outlet = run()
    assert coarse.counting  # inside a window of counted batches
    monkeypatch.setattr("prefetchx._thread_stage.COARSE_BELOW_S", 0.0)
    timed, timed_outlet = run()
    assert not timed.counting
    clock.now += 60.0  # the loop left the epoch a while ago
    coarse.close()
    timed.close()
    # The counted ones are filed at the close, as the same steps, without the time since.
    assert (coarse.stats.step.count, timed.stats.step.count) == (taken - 1, taken - 1)
    assert coarse.stats.step.total == pytest.approx(timed.stats.step.total)
    assert list(coarse_outlet) == list(timed_outlet) == []


class _Callers:
    """A source that notes which thread made each call; ``fail_at`` raises at that call."""

    def __init__(self, n: int, fail_at: int = -1) -> None:
        self.n, self.fail_at = n, fail_at
        self.callers: list[str] = []

    def __iter__(self) -> _Callers:
        return self

    def __next__(self) -> int:
        i = len(self.callers)
        if i >= self.n:
            raise StopIteration
        self.callers.append(threading.current_thread().name)
        if i == self.fail_at:
            raise ValueError(i)
        return i


@pytest.mark.parametrize("limit", [0, 1, 2, 5, 9, 12])
def test_the_thread_never_calls_the_source_past_the_limit(limit: int) -> None:
    # Over an epoch of 9 batches with len() 5 (a batch sampler's len() is only a promise), the
    # thread makes at most 5 calls, the first one included; the caller makes the rest, and the
    # error at call 3 counts as one call.
    source = _Callers(9, fail_at=3)
    stage = ThreadStage(source, max_prefetch=2, adaptive=False, limit=limit, name="worker")
    assert outcomes(stage) == [(("ValueError", (3,)), []) if i == 3 else (i, []) for i in range(9)]
    threaded = [i for i, name in enumerate(source.callers) if name == "worker"]
    assert all(i < limit for i in threaded), source.callers
    assert source.callers[max(1, limit) :] == ["MainThread"] * (9 - max(1, limit))
    assert not stage.producer_alive


@pytest.mark.parametrize("limit", [3, 5, 6, 7, 12])
def test_a_switching_stage_gives_the_thread_only_what_is_left_of_the_limit(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    # The thread and the caller take turns every other item: the calls each makes count
    # against one limit, and past it the thread is never resumed.
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", Switching)
    source = _Callers(12)
    stage = ThreadStage(source, max_prefetch=2, limit=limit, name="worker")
    assert outcomes(stage) == [(i, []) for i in range(12)]
    threaded = [i for i, name in enumerate(source.callers) if name == "worker"]
    assert threaded, source.callers  # the thread did take turns
    assert max(threaded) < limit, source.callers
    assert "worker" not in source.callers[limit:]


def test_a_limit_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="limit"):
        ThreadStage(iter(range(3)), limit=-1)


def test_the_thread_ends_once_the_limit_is_spent() -> None:
    # A loop that takes len() batches and never asks again (Lightning's) must not be left with
    # a thread waiting beside a finished epoch.
    source = _Callers(9)
    stage = ThreadStage(source, 2, adaptive=False, limit=5, name="worker", steal=False)
    assert [next(stage) for _ in range(5)] == list(range(5))
    assert wait_until(lambda: not stage.producer_alive)
    assert source.callers == ["MainThread"] + ["worker"] * 4
    assert next(stage) == 5  # and the next call is the caller's own
    assert source.callers[5] == "MainThread"
    stage.close()


# --- a stage composed after this one (the device stage) ------------------------------------------


class _Asked(_Callers):
    """`_Callers` that also records, for each call, whether a take ahead made it."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.taking_ahead = False
        self.ahead: list[bool] = []

    def __next__(self) -> int:
        self.ahead.append(self.taking_ahead)
        return super().__next__()


def _take_as_the_device_stage(stage: ThreadStage[int], source: _Asked) -> list[int]:
    """What the device stage does with ``device_prefetch=1``: with each outcome it hands over,
    a take ahead for the next one, then the count; a blocking take only with nothing ahead."""
    got: list[int] = []
    ahead: list[Any] = []
    while True:
        try:
            got.append(ahead.pop() if ahead else stage.take(block=True))
        except StopIteration:
            return got
        source.taking_ahead = True
        try:
            value = stage.take(block=False)
        except StopIteration:
            return got
        finally:
            source.taking_ahead = False
        if value is not Signal.NOT_READY:
            ahead.append(value)
        stage.counted()


def test_a_take_ahead_is_made_by_the_caller_while_it_makes_the_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The thread and the caller take turns every other item. A take ahead gets what the thread
    # made, or, while the caller makes the items, the item made then and there: the device
    # stage copies ahead in both modes. Never the call past the limit: that stays the loop's.
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", Switching)
    source = _Asked(40)
    stage = ThreadStage(source, max_prefetch=2, steal=False, limit=30, name="worker")
    assert _take_as_the_device_stage(stage, source) == list(range(40))
    made_ahead_here = [
        i
        for i, (ahead, name) in enumerate(zip(source.ahead, source.callers, strict=False))
        if ahead and name == "MainThread"
    ]
    assert made_ahead_here, source.callers  # the caller made items ahead while inline
    assert max(made_ahead_here) < 30
    assert "worker" in source.callers  # and the thread took its turns
    assert "worker" not in source.callers[30:]
    assert not any(source.ahead[30:])  # past the limit, each call is a blocking take's


def test_without_a_thread_a_take_ahead_makes_nothing() -> None:
    # max_prefetch=0: each item is made when the loop asks, as DataLoader makes it.
    source = _Asked(5)
    stage = ThreadStage(source, max_prefetch=0, steal=False)
    assert _take_as_the_device_stage(stage, source) == list(range(5))
    assert not any(source.ahead)


class _Alternating(Chooser):
    """The thread and the caller in turn, 4 items each, from the item after the first."""

    def start(self) -> tuple[bool, int]:
        self.threaded = True
        return True, 4

    def window(self, period: float, means: Any, ending: bool = False) -> tuple[bool, int]:
        self.threaded = not self.threaded
        return self.threaded, 4


def test_a_thread_resumed_but_kept_from_running_is_let_in_to_park_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop gives the source back to a parked thread, then takes it back before the thread
    # has run (a loop that holds the GIL). The thread is still in its old park's wait: the
    # caller must let it in to park again, or it goes on trying for the GIL, and slowing each
    # batch, long after the switch (before: taken for parked, it was not let in).
    monkeypatch.setattr("prefetchx._thread_stage.Chooser", _Alternating)
    monkeypatch.setattr("prefetchx._producer.PARK_WAIT", 30.0)
    stage = ThreadStage(iter(range(100)), max_prefetch=2)
    assert next(stage) == 0
    producer = _started(stage)
    items = [next(stage) for _ in range(4)]  # threaded; then the switch to the caller
    while not (stage._inline and producer.parked.is_set()):
        items.append(next(stage))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)  # from here the thread runs only where the caller lets it
    try:
        while stage._inline:  # on to the thread's turn: it is resumed, and cannot run
            items.append(next(stage))
        assert producer.resume_event.is_set()  # woken, not yet run
        while not stage._inline:  # the thread's turn; then the source is taken back
            items.append(next(stage))
        items.append(next(stage))
        # The thread ran, saw the source taken back and parked again.
        assert not producer.resume_event.is_set()
        assert producer.parked.is_set()
    finally:
        sys.setswitchinterval(interval)
    items += list(stage)
    assert items == list(range(1, 100))
