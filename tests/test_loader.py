"""DataLoaderX as a drop-in DataLoader: same batches, same API, no leaks, errors delivered."""

from __future__ import annotations

import inspect
import multiprocessing.context
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from prefetchx import DataLoaderX
from tests.helpers import (
    Counting,
    Gated,
    Squares,
    Stream,
    as_lists,
    child_pids,
    new_children,
    wait_until,
)


def _prefetchx_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]


def _loader_pair(
    max_prefetch: int = 2, **kwargs: object
) -> tuple[DataLoader[object], DataLoaderX[object]]:
    """A DataLoader and a DataLoaderX built from the same arguments and equally seeded."""
    dataset = kwargs.pop("dataset")
    plain = DataLoader(dataset, generator=torch.Generator().manual_seed(7), **kwargs)
    ours = DataLoaderX(
        dataset, generator=torch.Generator().manual_seed(7), max_prefetch=max_prefetch, **kwargs
    )
    return plain, ours


# --- same batches -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_prefetch", [0, 1, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_dataloader_map_style(max_prefetch: int, num_workers: int) -> None:
    plain, ours = _loader_pair(
        dataset=Squares(23),
        batch_size=4,
        shuffle=True,
        num_workers=num_workers,
        max_prefetch=max_prefetch,
    )
    for _ in range(2):  # two epochs: the sampler's generator advances alike
        assert as_lists(ours) == as_lists(plain)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_dataloader_iterable(num_workers: int) -> None:
    plain, ours = _loader_pair(dataset=Stream(30), batch_size=4, num_workers=num_workers)
    expected = as_lists(plain)
    assert as_lists(ours) == expected
    assert sorted(x for batch in expected for x in batch) == list(range(30))  # type: ignore[attr-defined]


# fork, forkserver (Python 3.14's default on Linux) and spawn (macOS and Windows): the last two
# give workers pickled arguments and a fresh interpreter.
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_persistent_workers_epochs_match_dataloader(start_method: str) -> None:
    plain, ours = _loader_pair(
        dataset=Squares(40),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=start_method,
    )
    records: list[list[object]] = []
    try:
        for loader in (plain, ours):
            record: list[object] = []
            for i, batch in enumerate(loader):  # epoch 1, broken after 3 batches
                record.append(batch.tolist())
                if i == 2:
                    break
            record.extend(as_lists(loader))  # epoch 2 in full
            record.extend(as_lists(loader))  # epoch 3 in full
            records.append(record)
    finally:
        ours.close()
        plain._iterator = None  # shut plain's persistent workers down too
    assert records[0] == records[1]
    assert len(records[1]) == 3 + 10 + 10


def test_empty_dataset_yields_nothing() -> None:
    assert list(DataLoaderX(Squares(0), batch_size=4)) == []
    assert list(DataLoaderX(Stream(0), batch_size=4)) == []


# --- the DataLoader API -----------------------------------------------------------------------


def test_is_a_dataloader_with_its_attributes() -> None:
    dataset = Squares(10)
    loader = DataLoaderX(dataset, 3, True, drop_last=True)  # positional arguments as DataLoader's
    assert isinstance(loader, DataLoader)
    assert len(loader) == 3
    assert loader.dataset is dataset
    assert loader.batch_size == 3
    assert loader.drop_last
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert loader.batch_sampler is not None
    assert loader.max_prefetch == 2


def test_signature_keeps_every_dataloader_argument() -> None:
    ours = inspect.signature(DataLoaderX).parameters
    for name, param in inspect.signature(DataLoader).parameters.items():
        assert name in ours
        assert ours[name].default == param.default
        assert ours[name].kind == param.kind
    assert ours["max_prefetch"].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["max_prefetch"].default == 2


def test_distributed_sampler_set_epoch_through_loader_sampler() -> None:
    def epoch_order(loader: DataLoader[torch.Tensor], epoch: int) -> list[object]:
        assert isinstance(loader.sampler, DistributedSampler)
        loader.sampler.set_epoch(epoch)
        return as_lists(loader)

    dataset = Squares(16)
    plain = DataLoader(
        dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    )
    ours = DataLoaderX(
        dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    )
    assert epoch_order(ours, 0) == epoch_order(plain, 0)
    assert epoch_order(ours, 1) == epoch_order(plain, 1)
    assert epoch_order(ours, 0) != epoch_order(ours, 1)


@pytest.mark.parametrize(
    ("value", "exc", "pattern"),
    [
        (-1, ValueError, r"`max_prefetch` must be >= 0, got -1\."),
        (2.0, TypeError, r"`max_prefetch` must be an int, got 2\.0 \(float\)"),
        (None, TypeError, r"`max_prefetch` must be an int, got None"),
        (True, TypeError, r"`max_prefetch` must be an int, got True \(bool\)"),
    ],
)
def test_bad_max_prefetch_raises_at_construction(
    value: object, exc: type[Exception], pattern: str
) -> None:
    with pytest.raises(exc, match=pattern):
        DataLoaderX(Squares(4), max_prefetch=value)  # type: ignore[arg-type]


# --- lifecycle ----------------------------------------------------------------------------------


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
    assert wait_until(
        lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    )


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
    assert dataset.iterators[0]() is not None
    del it
    assert wait_until(lambda: dataset.iterators[0]() is None)
    assert not _prefetchx_threads()


def test_iterator_close_is_idempotent() -> None:
    loader = DataLoaderX(Squares(100), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    it.close()
    it.close()
    assert not _prefetchx_threads()
    with pytest.raises(StopIteration):
        next(it)


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


@pytest.mark.parametrize("persistent", [False, True])
def test_new_iter_stops_the_previous_epoch_first(persistent: bool) -> None:
    plain, ours = _loader_pair(
        dataset=Squares(20),
        batch_size=2,
        shuffle=True,
        num_workers=2,
        persistent_workers=persistent,
    )
    try:
        # The same calls on both: one batch of epoch 1, then a new iter() mid-epoch.
        plain_first = next(iter(plain)).tolist()
        plain_second = as_lists(plain)
        first = iter(ours)
        assert next(first).tolist() == plain_first
        second = iter(ours)
        assert not first.producer_alive
        with pytest.raises(StopIteration):
            next(first)
        assert as_lists(second) == plain_second
    finally:
        ours.close()
        plain._iterator = None


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
def test_workers_start_from_the_calling_thread_with_no_prefetchx_thread_alive(
    persistent: bool,
) -> None:
    # FIELD pitfall 9: DataLoader installs its worker-failure handler only from the main
    # thread, and a process started while another thread runs may inherit its held locks.
    context = _WatchedStarts()
    loader = DataLoaderX(
        Squares(40),
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
        del it
        held = iter(loader)  # an epoch whose iterator is still held when the next one starts
        next(held)
        assert len(as_lists(loader)) == 20
    finally:
        loader.close()
    me = threading.current_thread().name
    assert context.starts == [(me, [])] * (2 if persistent else 10)


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
    del info
    # The loader can be iterated again, here up to the same failure.
    loader.dataset.fail_at = None  # type: ignore[attr-defined]
    assert len(list(loader)) == 5


def test_worker_error_keeps_type_and_shows_where() -> None:
    loader = DataLoaderX(Squares(10, fail_at=5), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="boom at index 5") as info:
        list(loader)
    assert "__getitem__" in str(info.value)  # DataLoader's worker traceback, as text
    del info
    loader.dataset.fail_at = None  # type: ignore[attr-defined]
    assert len(list(loader)) == 5


def test_collate_error_keeps_type() -> None:
    def collate(items: list[torch.Tensor]) -> torch.Tensor:
        raise LookupError(f"cannot collate {len(items)} items")

    with pytest.raises(LookupError, match="cannot collate 2 items"):
        list(DataLoaderX(Squares(4), batch_size=2, collate_fn=collate))


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
    # close() waits for the thread, which is inside DataLoader's own timed wait for the dead
    # worker (up to its 5 s status-check interval) before it sees the stop event.
    it.close()


def test_gated_producer_blocks_only_the_consumer_of_that_batch() -> None:
    dataset = Gated(6, block_at=2)
    it = iter(DataLoaderX(dataset, batch_size=1, max_prefetch=4))
    assert next(it).tolist() == [0]
    assert next(it).tolist() == [1]
    assert dataset.reached.wait(10)
    dataset.gate.set()
    assert as_lists(it) == [[2], [3], [4], [5]]


# --- Ctrl-C and interpreter exit, in a child interpreter -----------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ctrl_c_while_waiting_raises_keyboard_interrupt_promptly(num_workers: int) -> None:
    child = _python(f"""
from prefetchx import DataLoaderX
from tests.helpers import Squares
loader = DataLoaderX(Squares(10, delay=60), batch_size=1, num_workers={num_workers})
it = iter(loader)
print("waiting", flush=True)
next(it)
""")
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "waiting"
    time.sleep(0.5)  # let the child block in next()
    start = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert "KeyboardInterrupt" in err, err
    assert child.returncode != 0
    assert elapsed < 5.0, f"took {elapsed:.1f} s to exit after Ctrl-C"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_interpreter_exits_cleanly_mid_epoch(num_workers: int) -> None:
    child = _python(f"""
from prefetchx import DataLoaderX
from tests.helpers import Squares
loader = DataLoaderX(Squares(1000, delay=0.01), batch_size=2, num_workers={num_workers})
it = iter(loader)
next(it)
print("done", flush=True)
""")
    start = time.monotonic()
    out, err = child.communicate(timeout=60)
    assert out.strip() == "done"
    assert child.returncode == 0, err
    assert "Traceback" not in err, err
    assert "Exception ignored" not in err, err
    assert time.monotonic() - start < 30


def test_loader_stats_describe_the_last_epoch() -> None:
    loader = DataLoaderX(Squares(12, delay=0.005), batch_size=3)
    assert loader.stats.batches == 0
    for _ in loader:
        pass
    assert loader.stats.batches == 4
    assert loader.stats.verdict().startswith("input-bound")
    first = loader.stats
    list(loader)
    assert loader.stats is not first


class _SlowAfterFirst(Squares):
    """Item 0 at once, every later item after 1.5 s: the thread waits inside next()."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i > 0:
            time.sleep(1.5)
        return super().__getitem__(i)


def test_new_epoch_refuses_to_reset_persistent_workers_under_a_running_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import prefetchx._loader
    import prefetchx._pipeline

    monkeypatch.setattr(prefetchx._pipeline, "JOIN_TIMEOUT", 0.2)
    monkeypatch.setattr(prefetchx._loader, "JOIN_TIMEOUT", 0.2)
    loader = DataLoaderX(
        _SlowAfterFirst(4), batch_size=1, num_workers=2, persistent_workers=True, max_prefetch=1
    )
    try:
        it = iter(loader)
        next(it)
        # What an interrupt while waiting leaves: the thread told to stop, not waited for, and
        # still inside the DataLoader iterator; then the iterator is dropped.
        assert it._producer is not None  # type: ignore[union-attr]
        it._producer.interrupted = True  # type: ignore[union-attr]
        it._producer.stop()  # type: ignore[union-attr]
        del it
        with pytest.raises(RuntimeError, match=r"persistent_workers=True shares that iterator"):
            iter(loader)
        # Once the thread has left the iterator, a new epoch starts normally.
        assert wait_until(lambda: not _prefetchx_threads(), timeout=15)
        assert len(list(loader)) == 4
    finally:
        loader.close()
