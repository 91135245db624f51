"""The lifecycle of one DataLoaderX iterator: leaving it never waits, nothing is left behind."""

from __future__ import annotations

import gc
import logging
import multiprocessing.context
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import leftovers
from prefetchx import DataLoaderX, Prefetcher, _engine
from prefetchx._choose import Decision
from prefetchx._iterator import PrefetchIterator
from prefetchx._meter import Meter
from tests.helpers import (
    ALWAYS_THREADED,
    REPO,
    AlwaysAlone,
    Counting,
    Gated,
    SlowAfterFirst,
    Squares,
    Stream,
    as_lists,
    both,
    child_pids,
    new_children,
    wait_until,
)


def _prefetchx_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


# --- leaving an iterator ---------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_early_break_stops_thread_and_workers(num_workers: int) -> None:
    before = child_pids()
    loader = DataLoaderX(Squares(100), batch_size=2, num_workers=num_workers)
    workers: list[psutil.Process] = []
    for i, _ in enumerate(loader):
        if i == 1:
            workers = new_children(before)
            assert _prefetchx_threads()
            break
    assert len(workers) == num_workers
    # The `for` loop's iterator is dropped with the loop: the thread and workers must go.
    assert wait_until(lambda: not _prefetchx_threads())
    assert wait_until(lambda: not _alive(workers))


def test_an_error_in_the_step_reaches_the_caller_without_waiting_for_the_thread() -> None:
    dataset = Gated(10, block_at=1)
    loader = DataLoaderX(dataset, batch_size=1)
    with pytest.raises(ValueError, match="step failed"):
        for _ in loader:
            assert dataset.reached.wait(10)  # the thread is inside item 1, gated
            raise ValueError("step failed")
    # Here with the gate still shut: the way out did not wait for the thread's item.
    assert not dataset.gate.is_set()
    assert _prefetchx_threads()
    dataset.gate.set()
    assert wait_until(lambda: not _prefetchx_threads())


def test_break_over_a_blocked_dataset_returns_at_once_and_close_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_engine, "JOIN_TIMEOUT", 0.5)
    dataset = Gated(10, block_at=2)
    loader = DataLoaderX(dataset, batch_size=1)
    with caplog.at_level(logging.WARNING, logger="prefetchx"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the break itself warns of nothing
        for i, _ in enumerate(loader):
            if i == 1:
                assert dataset.reached.wait(10)  # the thread is blocked in item 2
                break
        gc.collect()
    assert caplog.records == []
    assert not dataset.gate.is_set()
    assert _prefetchx_threads()
    # loader.close() waits for the dropped iterator's thread, bounded, and says so.
    with pytest.warns(RuntimeWarning, match=r"waiting up to 0.5 s .*'prefetchx-thread'"):
        loader.close()
    assert _prefetchx_threads()  # gave up waiting: the gate is still shut
    dataset.gate.set()
    assert wait_until(lambda: not _prefetchx_threads())


def test_close_waits_bounded_for_a_thread_inside_the_dataset_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_engine, "JOIN_TIMEOUT", 0.3)
    dataset = Gated(10, block_at=2)
    it = iter(DataLoaderX(dataset, batch_size=1))
    next(it)
    assert dataset.reached.wait(10)
    with pytest.warns(RuntimeWarning) as warned:
        it.close()
    said = " ".join(str(w.message) for w in warned)
    assert "waiting up to 0.3 s for thread 'prefetchx-thread'" in said
    assert "_SingleProcessDataLoaderIter" in said  # what it waits for
    assert "did not return" in said
    assert it.producer_alive
    dataset.gate.set()
    assert wait_until(lambda: not it.producer_alive)


class _Items:
    """An iterator object a test can hold a weak reference to."""

    def __init__(self, n: int) -> None:
        self.it = iter(range(n))

    def __iter__(self) -> _Items:
        return self

    def __next__(self) -> int:
        return next(self.it)


class _ItemStream(torch.utils.data.IterableDataset[int]):
    def __init__(self) -> None:
        self.iterators: list[weakref.ref[_Items]] = []

    def __iter__(self) -> _Items:
        items = _Items(10**6)
        self.iterators.append(weakref.ref(items))
        return items


def test_dropped_iterator_releases_the_source_iterator() -> None:
    dataset = _ItemStream()
    it = iter(DataLoaderX(dataset, batch_size=2))
    next(it)
    next(it)
    assert dataset.iterators[0]() is not None
    del it
    assert wait_until(lambda: dataset.iterators[0]() is None)
    assert wait_until(lambda: not _prefetchx_threads())


def test_iterator_close_is_idempotent() -> None:
    loader = DataLoaderX(Squares(100), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    it.close()
    it.close()
    assert not _prefetchx_threads()
    with pytest.raises(StopIteration):
        next(it)
    assert len(it) == 50  # as DataLoader's iterator, also once closed


def test_loader_close_and_context_manager_then_reopen() -> None:
    with DataLoaderX(Squares(10), batch_size=5, num_workers=2, persistent_workers=True) as loader:
        it = iter(loader)
        next(it)
    assert not it.producer_alive
    assert loader._iterator is None  # persistent workers released
    loader.close()  # idempotent
    # A closed loader reopens: a full epoch, then close again.
    assert len(list(loader)) == 2
    loader.close()


def test_loader_close_stops_every_running_iterator() -> None:
    loader = DataLoaderX(Squares(40), batch_size=2)
    first, second = iter(loader), iter(loader)
    next(first)
    next(second)
    loader.close()
    assert not first.producer_alive
    assert not second.producer_alive
    assert list(first) == []


def test_source_iterator_is_created_on_the_calling_thread() -> None:
    dataset = Stream(5)
    assert as_lists(DataLoaderX(dataset, batch_size=2)) == [[0, 1], [2, 3], [4]]
    assert dataset.iter_threads == [threading.current_thread().name]


class _WatchedStarts(multiprocessing.context.ForkContext):
    """A multiprocessing context that notes, at each worker's start, the starting thread and
    the ``prefetchx-*`` threads alive then."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[str, list[str]]] = []
        watched = self

        class Process(multiprocessing.context.ForkProcess):
            def start(self) -> None:
                prefetchx = [t.name for t in _prefetchx_threads()]
                watched.starts.append((threading.current_thread().name, prefetchx))
                super().start()

        self.Process = Process  # type: ignore[misc,assignment]


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_start_from_the_calling_thread_with_no_abandoned_thread_alive(
    persistent: bool,
) -> None:
    # FIELD pitfall 9: DataLoader installs its worker-failure handler only from the main
    # thread, and a process started while another thread runs may inherit its held locks. A
    # dropped iterator's thread is not waited for when it is dropped, but before new workers
    # start.
    context = _WatchedStarts()
    loader = DataLoaderX(
        SlowAfterFirst(40, seconds=0.05),
        batch_size=2,
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context=context,
    )
    try:
        assert len(as_lists(loader)) == 20  # a whole epoch
        for _batch in loader:  # an epoch broken after one batch
            break
        it = iter(loader)  # an epoch whose iterator is dropped mid-epoch
        next(it)
        next(it)
        del it
        assert len(as_lists(loader)) == 20
    finally:
        loader.close()
    me = threading.current_thread().name
    assert context.starts == [(me, [])] * (2 if persistent else 8)


def test_memory_is_bounded_by_max_prefetch() -> None:
    dataset = Counting(1000)
    loader = DataLoaderX(dataset, batch_size=1, max_prefetch=3)
    it = iter(loader)
    next(it)
    # 1 consumed + 3 waiting in the queue + 1 in the thread's hand, blocked on the full queue.
    assert wait_until(lambda: dataset.produced == 5)
    time.sleep(0.3)
    assert dataset.produced == 5
    it.close()


def test_overlap_of_data_and_step() -> None:
    # Data and step each sleep 20 ms per batch: serial is 10 x (data + step), overlapped about
    # 11 x max(data, step). The serial time is measured here too, so a machine whose sleeps
    # overshoot slows both sides alike, and the bound is generous.
    step = 0.02

    def epoch(loader: DataLoader[torch.Tensor]) -> float:
        start = time.perf_counter()
        for _ in loader:
            time.sleep(step)
        return time.perf_counter() - start

    serial = epoch(DataLoader(Squares(10, delay=step), batch_size=1))
    overlapped = epoch(DataLoaderX(Squares(10, delay=step), batch_size=1, max_prefetch=2))
    assert overlapped < 0.8 * serial, (overlapped, serial)


# --- failures -----------------------------------------------------------------------------------


def test_dataset_error_keeps_type_message_and_traceback() -> None:
    loader = DataLoaderX(Squares(10, fail_at=5), batch_size=2)
    seen = []
    with pytest.raises(ValueError, match="boom at index 5") as info:
        for batch in loader:
            seen.append(batch.tolist())
    assert seen == [[[0, 0], [1, 1]], [[2, 4], [3, 9]]]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "__getitem__" in frames


def test_worker_error_keeps_type_and_shows_where(monkeypatch: pytest.MonkeyPatch) -> None:
    # After a worker's error, DataLoader joins each worker for 5 s before it terminates it,
    # under DataLoaderX too; 0.5 s here, and the iterator dropped while that is patched.
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    loader = DataLoaderX(Squares(10, fail_at=5), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="boom at index 5") as info:
        list(loader)
    assert "__getitem__" in str(info.value)  # DataLoader's worker traceback, as text
    del info  # its traceback holds the iterator
    gc.collect()


class Abort(BaseException):
    pass


@pytest.mark.parametrize("error", [Abort("abort"), KeyboardInterrupt()])
def test_base_exception_is_never_a_quiet_end_of_epoch(error: BaseException) -> None:
    loader = DataLoaderX(Squares(10, fail_at=3, error=error), batch_size=1)
    seen = []
    with pytest.raises(type(error)):
        for batch in loader:
            seen.append(batch)
    assert len(seen) == 3


def test_killed_worker_is_an_error_not_a_hang() -> None:
    before = child_pids()
    loader = DataLoaderX(Squares(100, delay=0.2), batch_size=1, num_workers=2)
    it = iter(loader)
    next(it)
    workers = new_children(before)
    assert workers
    os.kill(workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?i)worker"):
        for _ in range(100):
            next(it)
    assert time.monotonic() - start < 30
    it.close()


def test_gated_producer_blocks_only_the_consumer_of_that_batch() -> None:
    dataset = Gated(6, block_at=2)
    it = iter(DataLoaderX(dataset, batch_size=1, max_prefetch=4))
    assert next(it).tolist() == [0]
    assert next(it).tolist() == [1]
    assert dataset.reached.wait(10)
    dataset.gate.set()
    assert as_lists(it) == [[2], [3], [4], [5]]


# --- a worker that never answers ---------------------------------------------------------------


class _StuckAt(Dataset[int]):
    """Item ``stuck`` never returns (in a worker process)."""

    def __init__(self, n: int, stuck: int) -> None:
        self.n = n
        self.stuck = stuck

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.stuck:
            time.sleep(90)  # a test that fails to release it leaks it for no longer
        return i


RELEASE_WAIT = 40.0
"""Seconds a stuck worker may take to be released: REAP_AFTER, then DataLoader's own 5 s poll
and its join before it terminates the worker."""


@pytest.mark.parametrize("how", ["break", "close", "new epoch"])
def test_a_worker_that_never_answers_is_released_as_dataloader_releases_it(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both loaders join a worker for MP_STATUS_CHECK_INTERVAL (5 s) before they terminate it;
    # 0.5 s here for both, with the reaper's wait and close()'s wait for the thread cut to
    # 0.5 s and 1 s, keep the test short. The thread's own poll of the workers stays 5 s.
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    monkeypatch.setattr(_engine, "REAP_AFTER", 0.5)
    monkeypatch.setattr(_engine, "JOIN_TIMEOUT", 1.0)
    # DataLoader: the dropped iterator's __del__ terminates the stuck worker after the join.
    before = child_pids()
    plain_loader = DataLoader(_StuckAt(8, stuck=3), batch_size=1, num_workers=2)
    for i, _ in enumerate(plain_loader):
        if i == 1:
            break
    assert not _alive(new_children(before))

    before = child_pids()
    loader = DataLoaderX(_StuckAt(8, stuck=3), batch_size=1, num_workers=2)
    it = iter(loader)
    assert [int(next(it)), int(next(it))] == [0, 1]
    workers = new_children(before)
    assert len(workers) == 2
    assert wait_until(lambda: it._thread.inside_source)
    start = time.monotonic()
    if how == "break":
        del it
    elif how == "close":
        it.close()
    else:
        del it
        assert [int(b) for b in DataLoaderX(range(4), batch_size=1)] == [0, 1, 2, 3]
    assert time.monotonic() - start < RELEASE_WAIT
    threads, pids = leftovers(before, wait=RELEASE_WAIT)
    assert (threads, pids) == ([], [])
    assert not _alive(workers)


# --- persistent workers ------------------------------------------------------------------------


class _SlowAtOne(Squares):
    """Item 1 takes ``seconds``; every other item comes at once."""

    def __init__(self, n: int, seconds: float) -> None:
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:
            time.sleep(self.seconds)
        return super().__getitem__(i)


def _broken_slow_persistent(monkeypatch: pytest.MonkeyPatch) -> DataLoaderX[torch.Tensor]:
    """Persistent workers, an epoch broken after its first batch while the thread goes on into
    item 1 (2 s), and `close()` and resets that wait 0.3 s. Twelve batches: the thread makes
    none of the last four, whose calls draw what the workers' index queues need (see
    `prefetchx._iterator.loop_calls`)."""
    monkeypatch.setattr(_engine, "JOIN_TIMEOUT", 0.3)
    loader = DataLoaderX(
        _SlowAtOne(12, seconds=2.0),
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        max_prefetch=1,
    )
    for _ in loader:
        break
    return loader


def test_persistent_reset_refuses_while_a_thread_is_inside_and_never_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = _broken_slow_persistent(monkeypatch)
    try:
        for _attempt in range(2):  # refused, and refused again: never a hang
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"persistent_workers=True shares that"):
                iter(loader)
            assert time.monotonic() - start < 5
        # Once the thread has left the iterator, a new epoch starts normally.
        assert wait_until(lambda: not _prefetchx_threads(), timeout=20)
        assert len(list(loader)) == 12
    finally:
        loader.close()


def test_persistent_close_then_iter_starts_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = _broken_slow_persistent(monkeypatch)
    try:
        start = time.monotonic()
        loader.close()  # waits 0.3 s, then lets go of the iterator and its workers
        assert time.monotonic() - start < 5
        assert len(list(loader)) == 12  # new workers, no hang
    finally:
        loader.close()


# --- Ctrl-C and interpreter exit, in a child interpreter -----------------------------------------


def _python(code: str) -> subprocess.Popen[str]:
    """A child Python running ``code`` with the thread on, as in this process."""
    return subprocess.Popen(
        [sys.executable, "-c", ALWAYS_THREADED + code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ctrl_c_while_waiting_raises_keyboard_interrupt_promptly(num_workers: int) -> None:
    # The item takes 600 s: a child that waited for it after Ctrl-C would outlast the 60 s
    # the test gives it (a bound ten times over, not a timing).
    child = _python(f"""
from prefetchx import DataLoaderX
from tests.helpers import Squares
loader = DataLoaderX(Squares(10, delay=600), batch_size=1, num_workers={num_workers})
it = iter(loader)
print("waiting", flush=True)
next(it)
""")
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "waiting"
    time.sleep(0.5)  # let the child block in next()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert "KeyboardInterrupt" in err, err
    assert child.returncode != 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ctrl_c_in_the_step_is_raised_at_once_and_never_swallowed(num_workers: int) -> None:
    # The thread is inside a 30 s item when Ctrl-C comes in the training step: the interrupt
    # unwinds the loop at once, and a second Ctrl-C is not lost while it does.
    child = _python(f"""
import time
from prefetchx import DataLoaderX
from tests.helpers import SlowAfterFirst
loader = DataLoaderX(SlowAfterFirst(10, seconds=30), batch_size=1, num_workers={num_workers})
try:
    for batch in loader:
        print("step", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    time.sleep(60)
""")
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "step"
    time.sleep(1.0)  # the thread is inside item 1 now
    child.send_signal(signal.SIGINT)
    start = time.monotonic()
    assert child.stdout.readline().strip() == "interrupted"
    assert time.monotonic() - start < 3.0
    child.send_signal(signal.SIGINT)  # the second one ends the child
    _, err = child.communicate(timeout=60)
    assert time.monotonic() - start < 6.0
    assert "KeyboardInterrupt" in err, err
    assert "Exception ignored" not in err, err


@pytest.mark.parametrize("num_workers", [0, 2])
def test_interpreter_exits_at_once_and_cleanly_mid_epoch(num_workers: int) -> None:
    child = _python(f"""
from prefetchx import DataLoaderX
from tests.helpers import SlowAfterFirst
loader = DataLoaderX(SlowAfterFirst(1000, seconds=20), batch_size=1, num_workers={num_workers})
it = iter(loader)
next(it)
print("done", flush=True)
""")
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "done"
    start = time.monotonic()
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "Traceback" not in err, err
    assert "Exception ignored" not in err, err
    assert time.monotonic() - start < 10.0


def test_loader_stats_describe_the_epoch_started_last() -> None:
    loader = DataLoaderX(Squares(12, delay=0.005), batch_size=3)
    assert loader.stats.batches == 0
    for _ in loader:
        pass
    assert loader.stats.batches == 4
    assert loader.stats.verdict().startswith("input-bound")
    first = loader.stats
    it = iter(loader)
    assert loader.stats is not first
    assert loader.stats is it.stats
    it.close()


def test_interleaved_iterators_keep_their_own_stats() -> None:
    loader = DataLoaderX(Squares(12), batch_size=3)
    first, second = iter(loader), iter(loader)
    next(first)
    as_lists(second)
    assert (first.stats.batches, second.stats.batches) == (1, 4)
    first.close()


@pytest.mark.parametrize("step_s", [0.0, 0.003], ids=["short-steps", "long-steps"])
@pytest.mark.parametrize("batch_size", [2, 5], ids=["whole-last", "short-last"])
def test_the_call_that_ends_an_epoch_is_the_loops_own(step_s: float, batch_size: int) -> None:
    # RandomSampler draws from the loader's generator once more after its last index. A thread
    # that ran a left epoch to its end made that draw, which DataLoader never makes: every later
    # epoch of the loader changed (Lightning's CombinedLoader restarting a shorter loader). A
    # short last batch is made with that draw: the batch sampler fills it when the sampler ends.
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        loader = cls(Squares(12), batch_size=batch_size, shuffle=True, generator=torch.Generator())
        seen = []
        for taken in (2, 5, 6, 3, 2):  # epochs left at several points, and run to their end
            iterator = iter(loader)
            for _, batch in zip(range(taken), iterator, strict=False):
                seen.append(batch.tolist())
                time.sleep(step_s)
            del iterator
        return seen

    expected, got = both(run)
    assert got == expected


def test_a_prefetcher_leaves_the_last_short_batch_to_the_loop_too() -> None:
    # The same draw, for a DataLoader that a framework built: the loop makes its last batch.
    def run(wrap: Any) -> list[Any]:
        loader = wrap(
            DataLoader(Squares(12), batch_size=5, shuffle=True, generator=torch.Generator())
        )
        seen = []
        for taken in (1, 3, 1):
            iterator = iter(loader)
            for _, batch in zip(range(taken), iterator, strict=False):
                seen.append(batch.tolist())
                time.sleep(0.003)  # the thread, if it may, makes the last batch meanwhile
            del iterator
        return seen

    torch.manual_seed(0)
    expected = run(lambda loader: loader)
    torch.manual_seed(0)
    assert run(lambda loader: Prefetcher(loader, max_prefetch=4)) == expected


def test_batches_past_len_come_from_the_loops_thread() -> None:
    # A batch sampler's len() is only a promise: the batches past it come all the same.
    class Longer(torch.utils.data.Sampler[list[int]]):
        def __len__(self) -> int:
            return 3

        def __iter__(self) -> Iterator[list[int]]:
            return iter([[i] for i in range(6)])

    callers: list[str] = []

    def remember(batch: Any) -> Any:
        callers.append(threading.current_thread().name)
        return batch

    loader = DataLoaderX(range(6), batch_sampler=Longer(), collate_fn=remember, max_prefetch=2)
    assert [x for [x] in loader] == list(range(6))
    assert callers[3:] == ["MainThread"] * 3


# --- a fast loop, whatever the thread does: every outcome, counted exactly ---------------------


class _FailsAt(Dataset[int]):
    """Items ``0..n-1``; the indices in ``fail`` raise `ValueError`. Counts its calls."""

    def __init__(self, n: int, fail: set[int]) -> None:
        self.n, self.fail, self.calls = n, fail, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        if i in self.fail:
            raise ValueError(f"item {i}")
        return i


def _each(take: Any, check: Any = lambda: None) -> list[Any]:
    """Every outcome of ``take()`` until StopIteration, errors as text; ``check`` after each."""
    out: list[Any] = []
    while True:
        try:
            out.append(take())
        except StopIteration:
            return out
        except ValueError as exc:
            out.append(str(exc))
        check()


FAIL = {3, 200, 201, 555, 999}


@pytest.mark.adaptive
@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_a_fast_loops_counts_are_exact_at_every_batch(max_prefetch: int) -> None:
    # A loop of no work: the loader soon runs it without the thread. Read after every batch,
    # the meter counts exactly what the loop has had, errors apart.
    expected = _each(iter(DataLoader(_FailsAt(1000, FAIL), batch_size=None)).__next__)
    loader = DataLoaderX(_FailsAt(1000, FAIL), batch_size=None, max_prefetch=max_prefetch)
    it = iter(loader)
    seen: list[tuple[int, int]] = []
    got = _each(it.__next__, lambda: seen.append((loader.stats.batches, loader.stats.errors)))
    assert got == expected
    texts = [isinstance(value, str) for value in got]
    assert seen == [(k + 1 - sum(texts[: k + 1]), sum(texts[: k + 1])) for k in range(len(got))]
    assert loader.dataset.calls == 1000  # type: ignore[attr-defined]


@pytest.mark.adaptive
@pytest.mark.parametrize("max_prefetch", [0, 2])
@pytest.mark.parametrize("exit_by", ["break", "exception", "drop"])
def test_a_state_after_leaving_a_fast_loop_counts_what_the_loop_received(
    max_prefetch: int, exit_by: str
) -> None:
    # #63, item 1: with a loop of no work, a state taken after leaving the loop said 6 (34
    # without the thread) whatever the loop had received, and the resumed epoch repeated them.
    def loader() -> DataLoaderX[Any]:
        return DataLoaderX(range(1000), batch_size=1, max_prefetch=max_prefetch)

    first = loader()
    received: list[int] = []
    if exit_by == "drop":
        it = iter(first)
        received += [int(next(it)) for _ in range(700)]
        del it
    else:
        with pytest.raises(StopIteration) if exit_by == "break" else pytest.raises(KeyError):
            for batch in first:
                received.append(int(batch))
                if len(received) == 700:
                    if exit_by == "break":
                        raise StopIteration  # pytest.raises needs an exception: as a break
                    raise KeyError("the step failed")
    state = first.state_dict()
    assert state["consumed"] == 700
    assert first.stats.batches == 700
    again = loader()
    again.load_state_dict(state)
    assert received + [int(b) for b in again] == list(range(1000))


def test_a_loop_that_keeps_next_gets_every_outcome_across_windows_and_errors() -> None:
    # iter(it.__next__, None) and frameworks that keep the bound method: one callable for the
    # whole epoch, through windows, errors and switches, as DataLoader's.
    expected = _each(iter(DataLoader(_FailsAt(1000, FAIL), batch_size=None)).__next__)
    assert _each(iter(DataLoaderX(_FailsAt(1000, FAIL), batch_size=None)).__next__) == expected


@pytest.mark.adaptive
def test_close_in_a_fast_loop_calls_the_source_no_more_and_releases_it() -> None:
    dataset = _FailsAt(1000, set())
    it = iter(DataLoaderX(dataset, batch_size=None))
    take = it.__next__
    assert [take() for _ in range(300)] == list(range(300))
    source = weakref.ref(it._source)
    it.close()
    assert source() is None  # released with the close, as dropping it would
    with pytest.raises(StopIteration):
        take()
    assert dataset.calls <= 300 + 3  # the thread's lead at most, if it ran


@pytest.mark.adaptive
@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_dropping_an_iterator_releases_its_source_at_once(max_prefetch: int) -> None:
    def dropped(kind: Any) -> bool:
        it = iter(kind(_FailsAt(1000, set()), batch_size=None))
        for _ in range(300):
            next(it)
        source = weakref.ref(it._source if isinstance(it, PrefetchIterator) else it)
        del it
        return source() is None  # no gc pass: by reference counts alone

    assert dropped(DataLoader)
    assert dropped(lambda *a, **k: DataLoaderX(*a, max_prefetch=max_prefetch, **k))


class _HoldsAt(_FailsAt):
    """A dataset whose item ``at`` waits, inside the loop's call, until ``release`` is set."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n, set())
        self.at = at
        self.inside = threading.Event()
        self.release = threading.Event()

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            self.inside.set()
            assert self.release.wait(10)
        return super().__getitem__(i)


def test_a_close_from_another_thread_lets_the_loops_call_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop's thread is inside the dataset (no thread runs) when another thread closes
    # the iterator: that call returns its batch to the loop, the source goes once it has, and
    # the next call ends the epoch without another call of the dataset.
    monkeypatch.setattr("prefetchx._pipeline.Decision", AlwaysAlone)
    dataset = _HoldsAt(1000, 300)
    it = iter(DataLoaderX(dataset, batch_size=None))
    assert [next(it) for _ in range(300)] == list(range(300))
    source = weakref.ref(it._source)
    got: list[Any] = []
    loop = threading.Thread(target=lambda: got.extend(it))
    loop.start()
    assert dataset.inside.wait(10)
    it.close()
    assert source() is not None  # the call in progress holds it
    dataset.release.set()
    loop.join(10)
    assert not loop.is_alive()
    assert got == [300]
    assert source() is None
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.adaptive
def test_an_interrupt_while_the_meter_decides_is_raised_and_the_epoch_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The meter decides between two batches, before the next is taken: Ctrl-C there is raised
    # at once and loses nothing, and the next next() gives that batch.
    boundary = Meter._boundary
    interrupts = 0

    def interrupted(self: Meter) -> None:
        nonlocal interrupts
        boundary(self)
        if interrupts == 0 and self._stats.handed > 100:
            interrupts += 1
            raise KeyboardInterrupt  # Ctrl-C as a window ends

    monkeypatch.setattr(Meter, "_boundary", interrupted)
    loader = DataLoaderX(_FailsAt(1000, set()), batch_size=None)
    it = iter(loader)
    got: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        got.extend(it)
    assert interrupts == 1
    assert loader.stats.batches == len(got)
    got.extend(it)  # the loop goes on after it, as after any exception
    assert got == list(DataLoader(_FailsAt(1000, set()), batch_size=None))
    assert loader.stats.batches == 1000


def test_an_epochs_end_hands_the_decision_the_loops_time_since_its_last_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Epochs shorter than a window: the time after the last complete window counts at the
    # epoch's end, or a loop of short epochs never pays for a probe (tests/test_choose.py).
    made: list[Recording] = []

    class Recording(Decision):
        def __init__(self) -> None:
            super().__init__()
            self.ended: list[float] = []
            made.append(self)

        def epoch_ended(self, unmeasured: float = 0.0) -> None:
            self.ended.append(unmeasured)
            super().epoch_ended(unmeasured)

    monkeypatch.setattr("prefetchx._pipeline.Decision", Recording)
    loader = DataLoaderX(range(10), batch_size=None, device="cpu")
    for _ in range(3):
        assert list(loader) == list(range(10))
    (decision,) = made
    assert len(decision.ended) == 3
    assert min(decision.ended) >= 0.0
    assert sum(decision.ended) > 0.0
