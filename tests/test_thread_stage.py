"""The thread stage on its own: the same outcomes as calling the source, lifecycle, memory."""

from __future__ import annotations

import _thread
import gc
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from prefetchx import ThreadStage, _engine
from prefetchx._engine import Failure, Signal
from prefetchx._producer import Producer
from tests.helpers import ThreadGate, wait_until


class Abort(BaseException):
    """A BaseException that is not an Exception, as prefetch_generator lets slip."""


def _threads() -> list[threading.Thread]:
    """The stages' threads running now (the reaper, which outlives stages, is none of them)."""
    return [t for t in threading.enumerate() if t.name == "prefetchx-thread"]


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
def test_same_outcomes_as_calling_the_source(max_prefetch: int) -> None:
    expected = outcomes(_flaky())
    assert len(expected) == 40
    with ThreadStage(_flaky(), max_prefetch) as stage:
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
    assert _threads() == []


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
    stage = ThreadStage(source, max_prefetch=2)
    time.sleep(0.05)
    assert source.i == 0
    assert _threads() == []
    assert next(stage) == 0
    assert source.threads[0] == threading.current_thread().name
    (thread,) = _threads()
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
    assert _threads() == []


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
    (thread,) = _threads()
    del stage  # the last reference: the finalizer runs here
    # Returned while the thread is still inside the item, which waits for the gate (30 s):
    # the drop did not wait for it.
    assert thread.is_alive()
    assert not source.gate.is_set()
    source.gate.set()
    assert wait_until(lambda: not thread.is_alive())


def test_close_waits_bounded_says_so_and_whether_the_thread_is_still_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_engine, "JOIN_TIMEOUT", 0.2)
    source = Gate(10, block_at=1)
    stage = ThreadStage(source, max_prefetch=2)
    assert next(stage) == 0
    assert source.reached.wait(10)
    with pytest.warns(RuntimeWarning) as warned:
        stage.close()  # returns with the thread still inside the item (its gate is shut)
    assert not source.gate.is_set()
    assert stage.producer_alive
    said = [str(w.message) for w in warned]
    assert len(said) == 2, said
    assert "waiting up to 0.2 s for thread 'prefetchx-thread'" in said[0]
    assert "test_thread_stage.Gate" in said[0]  # what it waits for
    assert "did not return from test_thread_stage.Gate within 0.2 s" in said[1]
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


def test_a_thread_that_died_without_a_last_word_is_reported_not_waited_for() -> None:
    stage = ThreadStage(iter(range(5)), max_prefetch=2)
    assert next(stage) == 0
    producer = stage._producer
    assert isinstance(producer, Producer)
    producer.stop()
    producer.join(10)
    producer.stop_event.clear()  # as if it had died on its own
    producer._drain()
    value = producer.get()
    assert isinstance(value, Failure)
    assert isinstance(value.exc, RuntimeError)
    assert "prefetchx-thread" in str(value.exc)
    stage.close()


def test_a_producer_waiting_for_room_goes_on_as_soon_as_one_item_is_taken() -> None:
    made: list[int] = []

    def source() -> Iterator[int]:
        for i in range(100):
            made.append(i)
            yield i

    with ThreadStage(source(), max_prefetch=3) as stage:
        assert next(stage) == 0
        assert wait_until(lambda: len(made) == 5)  # 3 queued, 1 in hand waiting for room
        assert next(stage) == 1
        assert wait_until(lambda: len(made) == 6)  # room for one: made at once


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


def _switching(stage: ThreadStage[Any], every: int, between: Callable[[], object] = lambda: None):
    """Every outcome of ``stage``, switching it between the thread and the caller after every
    ``every`` items, as a loader's decision may."""
    out: list[Any] = []
    threaded = True
    while True:
        try:
            out.append(next(stage))
        except StopIteration:
            return out
        except ValueError as exc:
            out.append(("ValueError", exc.args))
        between()
        if len(out) % every == 0:
            threaded = not threaded
            stage.switch(threaded)


@pytest.mark.parametrize("every", [1, 2, 3, 7])
def test_switching_between_the_thread_and_the_caller_keeps_every_outcome_in_order(
    every: int,
) -> None:
    source = _Callers(60, fail_at=13)
    stage = ThreadStage(source, max_prefetch=2, name="worker")
    got = _switching(stage, every)
    assert got == [("ValueError", (13,)) if i == 13 else i for i in range(60)]
    assert "worker" in source.callers, source.callers
    assert "MainThread" in source.callers[1:], source.callers
    assert not stage.producer_alive


def test_a_park_hands_over_what_the_thread_made_first_then_the_caller_makes_the_rest() -> None:
    source = _Callers(20)
    stage = ThreadStage(source, max_prefetch=3, name="worker")
    assert next(stage) == 0
    assert wait_until(lambda: len(source.callers) == 5)  # 3 queued, 1 in hand
    stage.switch(False)
    assert stage.switching
    assert stage.threaded
    assert [next(stage) for _ in range(4)] == [1, 2, 3, 4]  # what the thread had made
    assert next(stage) == 5
    assert not stage.switching
    assert not stage.threaded
    assert source.callers[:5] == ["MainThread"] + ["worker"] * 4
    assert source.callers[5] == "MainThread"
    assert stage.producer_alive  # parked, not ended
    stage.switch(True)
    assert list(stage) == list(range(6, 20))
    assert "worker" in source.callers[6:]


def test_a_stage_switched_off_before_its_first_item_never_starts_its_thread() -> None:
    source = _Callers(5)
    stage = ThreadStage(source, max_prefetch=2)
    stage.switch(False)
    assert list(stage) == [0, 1, 2, 3, 4]
    assert _threads() == []
    assert set(source.callers) == {"MainThread"}


def test_a_resume_asked_while_the_thread_parks_takes_effect_once_it_has() -> None:
    source = _Callers(30)
    stage = ThreadStage(source, max_prefetch=2, name="worker")
    assert next(stage) == 0
    stage.switch(False)
    stage.switch(True)  # before the thread said PARKED
    assert list(stage) == list(range(1, 30))
    assert source.callers.count("MainThread") >= 1


def test_close_stops_a_parked_thread() -> None:
    stage = ThreadStage(iter(range(100)), max_prefetch=2)
    assert next(stage) == 0
    stage.switch(False)
    while stage.threaded:
        next(stage)
    assert stage.producer_alive
    stage.close()
    assert not stage.producer_alive


@pytest.mark.parametrize("limit", [0, 1, 2, 5, 9, 12])
def test_the_thread_never_calls_the_source_past_the_limit(limit: int) -> None:
    # Over an epoch of 9 batches with len() 5 (a batch sampler's len() is only a promise), the
    # thread makes at most 5 calls, the first one included; the caller makes the rest, and the
    # error at call 3 counts as one call.
    source = _Callers(9, fail_at=3)
    stage = ThreadStage(source, max_prefetch=2, limit=limit, name="worker")
    assert outcomes(stage) == [(("ValueError", (3,)), []) if i == 3 else (i, []) for i in range(9)]
    threaded = [i for i, name in enumerate(source.callers) if name == "worker"]
    assert all(i < limit for i in threaded), source.callers
    assert source.callers[max(1, limit) :] == ["MainThread"] * (9 - max(1, limit))
    assert not stage.producer_alive


@pytest.mark.parametrize("limit", [3, 5, 6, 7, 12])
def test_a_switching_stage_gives_the_thread_only_what_is_left_of_the_limit(limit: int) -> None:
    # The thread and the caller take turns every other item: the calls each makes count
    # against one limit, and past it the thread is never resumed.
    source = _Callers(12)
    stage = ThreadStage(source, max_prefetch=2, limit=limit, name="worker")
    assert _switching(stage, 2) == list(range(12))
    threaded = [i for i, name in enumerate(source.callers) if name == "worker"]
    assert threaded, source.callers  # the thread did take turns
    assert max(threaded) < limit, source.callers


def test_a_limit_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="limit"):
        ThreadStage(iter(range(3)), limit=-1)


def test_the_thread_ends_once_the_limit_is_spent() -> None:
    # A loop that takes len() batches and never asks again (Lightning's) must not be left with
    # a thread waiting beside a finished epoch.
    source = _Callers(9)
    stage = ThreadStage(source, 2, limit=5, name="worker")
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


def _take_as_the_device_stage(
    stage: ThreadStage[int], source: _Asked, switch_every: int = 0
) -> list[int]:
    """What the device stage does with ``device_prefetch=1``: with each outcome it hands over,
    a take ahead for the next one; a blocking take only with nothing ahead. With
    ``switch_every``, the stage is switched between the thread and the caller that often."""
    got: list[int] = []
    ahead: list[Any] = []
    threaded = True
    while True:
        try:
            got.append(ahead.pop() if ahead else stage.take())
        except StopIteration:
            return got
        source.taking_ahead = True
        try:
            value = stage.take_ahead()
        except StopIteration:
            return got
        finally:
            source.taking_ahead = False
        if value is not Signal.NOT_READY:
            ahead.append(value)
        if switch_every and len(got) % switch_every == 0:
            threaded = not threaded
            stage.switch(threaded)


def test_a_take_ahead_is_made_by_the_caller_while_it_makes_the_items() -> None:
    # The thread and the caller take turns. A take ahead gets what the thread made, or, while
    # the caller makes the items, the item made then and there: the device stage copies ahead
    # in both modes. Never the call past the limit: that stays the loop's.
    source = _Asked(40)
    stage = ThreadStage(source, max_prefetch=2, limit=30, name="worker")
    assert _take_as_the_device_stage(stage, source, switch_every=3) == list(range(40))
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
    stage = ThreadStage(source, max_prefetch=0)
    assert _take_as_the_device_stage(stage, source) == list(range(5))
    assert not any(source.ahead)


def test_a_take_ahead_never_waits_for_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = ThreadGate(monkeypatch)  # the thread makes nothing until the gate opens
    stage = ThreadStage(iter(range(10)), max_prefetch=2)
    assert stage.take() == 0
    assert stage.take_ahead() is Signal.NOT_READY
    gate.open.set()
    assert list(stage) == list(range(1, 10))
