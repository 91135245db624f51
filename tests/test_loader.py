"""DataLoaderX against DataLoader: the same code through both, in the same test, compared."""

from __future__ import annotations

import collections.abc
import copy
import gc
import inspect
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from prefetchx import DataLoaderX
from tests.helpers import (
    REPO,
    FailingSampler,
    Squares,
    Stream,
    Switching,
    as_lists,
    both,
    outcomes,
    plain,
    wait_until,
)


def _loader_pair(
    max_prefetch: int = 2, **kwargs: object
) -> tuple[DataLoader[object], DataLoaderX[object]]:
    """A DataLoader and a DataLoaderX built from the same arguments and equally seeded."""
    dataset = kwargs.pop("dataset")
    plain_loader = DataLoader(dataset, generator=torch.Generator().manual_seed(7), **kwargs)  # type: ignore[arg-type]
    ours = DataLoaderX(
        dataset,  # type: ignore[arg-type]
        generator=torch.Generator().manual_seed(7),
        max_prefetch=max_prefetch,
        **kwargs,
    )
    return plain_loader, ours


def _shut(loader: DataLoader[Any]) -> None:
    """Shut down a loader's persistent workers, whichever class it is."""
    if isinstance(loader, DataLoaderX):
        loader.close()
    else:
        loader._iterator = None


# --- same batches -------------------------------------------------------------------------------


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("max_prefetch", [0, 1, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_dataloader_map_style(max_prefetch: int, num_workers: int) -> None:
    plain_loader, ours = _loader_pair(
        dataset=Squares(23),
        batch_size=4,
        shuffle=True,
        num_workers=num_workers,
        max_prefetch=max_prefetch,
    )
    for _ in range(2):  # two epochs: the sampler's generator advances alike
        assert as_lists(ours) == as_lists(plain_loader)


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_dataloader_iterable(num_workers: int) -> None:
    plain_loader, ours = _loader_pair(dataset=Stream(30), batch_size=4, num_workers=num_workers)
    expected = as_lists(plain_loader)
    assert as_lists(ours) == expected
    assert sorted(x for batch in expected for x in batch) == list(range(30))  # type: ignore[attr-defined]


# fork, forkserver (Python 3.14's default on Linux) and spawn (macOS and Windows): the last two
# give workers pickled arguments and a fresh interpreter. The thread stage does not see how
# its workers started: fork runs in both of its modes, the others in one each (6 s a run).
@pytest.mark.parametrize(
    ("start_method", "both_modes"),
    [
        ("fork", "threaded"),
        ("fork", "switching"),
        ("forkserver", "switching"),
        ("spawn", "threaded"),
    ],
    indirect=["both_modes"],
)
def test_persistent_workers_epochs_match_dataloader(start_method: str, both_modes: str) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        loader = cls(
            Squares(40),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context=start_method,
            generator=torch.Generator().manual_seed(7),
        )
        record: list[Any] = []
        try:
            for i, batch in enumerate(loader):  # epoch 1, broken after 3 batches
                record.append(batch.tolist())
                if i == 2:
                    break
            record.extend(as_lists(loader))  # epoch 2 in full
            record.extend(as_lists(loader))  # epoch 3 in full
        finally:
            _shut(loader)
        return record

    plain_record, ours = both(run)
    assert ours == plain_record
    assert len(ours) == 3 + 10 + 10


def test_empty_dataset_yields_nothing() -> None:
    assert list(DataLoaderX(Squares(0), batch_size=4)) == []
    assert list(DataLoaderX(Stream(0), batch_size=4)) == []


# --- independent iterators (FIELD pitfall 14) ------------------------------------------------


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (2, True)], ids=["w0", "w2", "w2p"]
)
def test_zip_of_a_loader_with_itself(num_workers: int, persistent: bool) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        loader = cls(
            Squares(14),
            batch_size=3,
            shuffle=True,
            num_workers=num_workers,
            persistent_workers=persistent,
        )
        try:
            return [(plain(a), plain(b)) for a, b in zip(loader, loader, strict=False)]
        finally:
            _shut(loader)

    plain_pairs, ours = both(run)
    assert ours == plain_pairs
    assert ours  # DataLoaderX once yielded nothing here


@pytest.mark.parametrize("num_workers", [0, 2])
def test_nested_loops_over_one_loader(num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        loader = cls(Squares(9), batch_size=3, shuffle=True, num_workers=num_workers)
        return [(plain(outer), as_lists(loader)) for outer in loader]

    plain_record, ours = both(run)
    assert ours == plain_record
    assert len(ours) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_peek_and_validation_pass_inside_a_training_loop(num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        loader = cls(Squares(20), batch_size=2, shuffle=True, num_workers=num_workers)
        record: list[Any] = []
        for step, batch in enumerate(loader):
            record.append(plain(batch))
            if step == 2:
                record.append(("peek", plain(next(iter(loader)))))
            if step == 5:
                record.append(("validation", as_lists(loader)))
        return record

    plain_record, ours = both(run)
    assert ours == plain_record
    assert len([r for r in ours if not isinstance(r, tuple)]) == 10


def test_two_threads_calling_iter_at_once_each_get_a_whole_epoch() -> None:
    loader = DataLoaderX(Squares(24), batch_size=2, num_workers=2)
    expected = as_lists(DataLoader(Squares(24), batch_size=2))
    barrier = threading.Barrier(2)
    got: dict[int, list[Any]] = {}

    def epoch(k: int) -> None:
        barrier.wait()
        got[k] = as_lists(loader)

    threads = [threading.Thread(target=epoch, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert got == {0: expected, 1: expected}


# --- errors (FIELD pitfall 16) --------------------------------------------------------------


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("max_prefetch", [0, 2])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_does_not_end_the_epoch(max_prefetch: int, num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        kwargs = {"max_prefetch": max_prefetch} if cls is DataLoaderX else {}
        loader = cls(Squares(12, fail_at=5), batch_size=2, num_workers=num_workers, **kwargs)
        return outcomes(iter(loader))

    plain_record, ours = both(run)
    assert ours == plain_record
    assert ours[2][0].startswith("ValueError: ")  # batch 2 failed; 3, 4, 5 follow
    assert len(ours) == 6


def test_an_error_on_the_cpu_normalization_path_does_not_end_the_epoch() -> None:
    class Mixed(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> torch.Tensor:
            channels = 5 if i == 2 else 3  # one sample the normalization refuses
            return torch.full((channels, 2, 2), i, dtype=torch.uint8)

    loader = DataLoaderX(Mixed(), batch_size=1, mean=(0, 0, 0), std=(1, 1, 1))
    got = outcomes(iter(loader))
    assert [value if isinstance(value, str) else value[0][0][0][0] for value, _ in got] == [
        0.0,
        1.0,
        "ValueError: `mean`/`std` have 3 channels but the input has 5 (shape (1, 5, 2, 2); "
        "channels are dim 1).",
        3.0,
        4.0,
        5.0,
    ]


def _failing_stream(n: int, fail_at: int) -> Iterator[int]:
    for i in range(n):
        if i == fail_at:
            raise KeyError(f"stream broke at {i}")
        yield i


class _FailingStream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return _failing_stream(10, 5)


@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_an_iterable_dataset_that_raises_ends_as_with_dataloader(max_prefetch: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        kwargs = {"max_prefetch": max_prefetch} if cls is DataLoaderX else {}
        return outcomes(iter(cls(_FailingStream(), batch_size=2, **kwargs)))

    plain_record, ours = both(run)
    assert ours == plain_record


def test_collate_errors_are_per_batch() -> None:
    def collate(items: list[torch.Tensor]) -> torch.Tensor:
        if int(items[0][0]) == 4:
            raise LookupError(f"cannot collate {len(items)} items")
        return torch.stack(items)

    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        return outcomes(iter(cls(Squares(8), batch_size=2, collate_fn=collate)))

    plain_record, ours = both(run)
    assert ours == plain_record
    assert ours[2][0] == "LookupError: cannot collate 2 items"


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("max_prefetch", [0, 2])
@pytest.mark.parametrize(("num_workers", "fail_at"), [(0, 1), (0, 3), (2, 7)])
def test_a_sampler_error_does_not_end_the_epoch(
    max_prefetch: int, num_workers: int, fail_at: int
) -> None:
    # DataLoader asks the sampler again at the next batch; its recorder for state_dict must too.
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        kwargs = {"max_prefetch": max_prefetch} if cls is DataLoaderX else {}
        sampler = FailingSampler(12, fail_at)
        loader = cls(
            Squares(12), sampler=sampler, batch_size=None, num_workers=num_workers, **kwargs
        )
        return outcomes(iter(loader))

    plain_record, ours = both(run)
    assert ours == plain_record
    assert [value for value, _ in ours].count(f"IndexError: no index at draw {fail_at}") == 1
    assert len(ours) >= 11  # every index but the failed draw's (with workers, one more is lost)


class _EmptyThenRevives(Sampler[int]):
    """A sampler whose iterator ends at once, then, asked again, yields once more (an iterator
    that is not a generator may)."""

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[int]:
        return _Revives()


class _Revives:
    """Ends at its first ``next()``, yields at the second."""

    def __init__(self) -> None:
        self.asked = 0

    def __iter__(self) -> _Revives:
        return self

    def __next__(self) -> int:
        self.asked += 1
        if self.asked == 1:
            raise StopIteration
        return 1


def test_an_empty_epoch_ends_at_the_first_next_as_with_dataloader() -> None:
    # DataLoader's first next() asks the sampler once and stops; asking it again in the same
    # call (the position recorder's next part) would get a batch DataLoader never makes.
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        return outcomes(iter(cls(Squares(4), sampler=_EmptyThenRevives(), batch_size=None)), 1)

    plain_record, ours = both(run)
    assert ours == plain_record == []


# --- samplers are iterated as DataLoader iterates them (FIELD pitfall 17) ---------------------


class RestartingBatchSampler:
    """Restarts itself in ``__iter__`` and returns itself, as Lightning's predict wrapper does."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.inner = BatchSampler(SequentialSampler(range(n)), batch_size, drop_last=False)
        self.iters = 0
        self._it: Iterator[list[int]] = iter([])

    def __iter__(self) -> RestartingBatchSampler:
        self.iters += 1
        self._it = iter(self.inner)
        return self

    def __next__(self) -> list[int]:
        return next(self._it)

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (2, True)], ids=["w0", "w2", "w2p"]
)
def test_a_batch_sampler_that_restarts_itself_is_iterated_as_by_dataloader(
    num_workers: int, persistent: bool
) -> None:
    def run(cls: type[DataLoader[Any]]) -> tuple[list[Any], int]:
        sampler = RestartingBatchSampler(10, 3)
        loader = cls(
            Squares(10),
            batch_sampler=sampler,
            num_workers=num_workers,
            persistent_workers=persistent,
        )
        try:
            epochs = [as_lists(loader) for _ in range(2)]
        finally:
            _shut(loader)
        return epochs, sampler.iters

    plain_record, ours = both(run)
    assert ours == plain_record
    assert len(ours[0][0]) == 4  # the first batch once, the last one there


# --- random draws in DataLoader's order (FIELD pitfall 15) ------------------------------------

SAMPLERS = {
    "shuffle": lambda data: {"shuffle": True},
    "replacement": lambda data: {"sampler": RandomSampler(data, replacement=True, num_samples=40)},
    "subset": lambda data: {"sampler": SubsetRandomSampler(list(range(0, len(data), 2)))},
    "weighted": lambda data: {
        "sampler": WeightedRandomSampler([1.0 + i % 3 for i in range(len(data))], 30)
    },
    "batch_sampler": lambda data: {
        "batch_sampler": BatchSampler(RandomSampler(data), batch_size=3, drop_last=True)
    },
    "distributed": lambda data: {
        "sampler": DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=4)
    },
}


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_draws_interleave_with_the_callers_as_in_dataloader(kind: str, num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        data = Squares(24)
        args = SAMPLERS[kind](data)
        if "batch_sampler" not in args:
            args["batch_size"] = 4
        loader = cls(data, num_workers=num_workers, **args)
        record: list[Any] = []
        for _ in range(2):
            it = iter(loader)
            record.append(torch.rand(1).item())  # the caller draws between iter() and next()
            record.append(as_lists(it))
            record.append(torch.rand(1).item())
        return record

    plain_record, ours = both(run)
    assert ours == plain_record


@pytest.mark.parametrize("num_workers", [0, 2])
def test_zip_of_two_shuffled_loaders_on_the_global_rng(num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        first = cls(Squares(12), batch_size=3, shuffle=True, num_workers=num_workers)
        second = cls(Squares(12), batch_size=4, shuffle=True, num_workers=num_workers)
        pairs = [(plain(a), plain(b)) for a, b in zip(first, second, strict=False)]
        return [pairs, torch.rand(2).tolist()]

    plain_record, ours = both(run)
    assert ours == plain_record


class _DrawsInGetitem(Dataset[float]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> float:
        return float(torch.rand(1))


def test_a_dataset_drawing_the_global_rng_is_exact_with_the_documented_ways_out() -> None:
    # With num_workers=0 and a thread, such draws interleave with the caller's (documented);
    # with max_prefetch=0 they are DataLoader's exactly.
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        kwargs = {"max_prefetch": 0} if cls is DataLoaderX else {}
        loader = cls(_DrawsInGetitem(), batch_size=2, **kwargs)
        record = []
        for batch in loader:
            record.append((plain(batch), torch.rand(1).item()))
        return record

    plain_record, ours = both(run)
    assert ours == plain_record


# --- warnings at the batch they belong to -----------------------------------------------------


class _Overlong(IterableDataset[int]):
    """Says it has 6 items and yields 10: DataLoader warns from the 7th batch of size 1 on."""

    def __len__(self) -> int:
        return 6

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))

    def __repr__(self) -> str:
        return "Overlong()"  # DataLoader's message shows it


@pytest.mark.parametrize("max_prefetch", [0, 4])
def test_dataloaders_length_warning_comes_with_the_same_batch(max_prefetch: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        kwargs = {"max_prefetch": max_prefetch} if cls is DataLoaderX else {}
        loader = cls(_Overlong(), batch_size=1, **kwargs)
        assert len(loader) == 6
        return outcomes(iter(loader))

    plain_record, ours = both(run)
    assert ours == plain_record
    assert [bool(w) for _, w in ours] == [False] * 6 + [True] * 4


class _WarnsAt(Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i in (3, 6):
            warnings.warn(f"sample {i} looks odd", UserWarning, stacklevel=1)
        return i


@pytest.mark.usefixtures("both_modes")
def test_a_datasets_warnings_come_with_their_batch() -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        return outcomes(iter(cls(_WarnsAt(), batch_size=2)))

    plain_record, ours = both(run)
    assert ours == plain_record


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
    assert DataLoaderX(dataset=dataset).dataset is dataset  # by keyword too


def test_signature_keeps_every_dataloader_argument() -> None:
    ours = inspect.signature(DataLoaderX).parameters
    for name, param in inspect.signature(DataLoader).parameters.items():
        assert name in ours
        assert ours[name].default == param.default
        assert ours[name].kind == param.kind
    assert ours["max_prefetch"].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["max_prefetch"].default == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterators_have_dataloaders_len(num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> list[Any]:
        it = iter(cls(Squares(10), batch_size=3, num_workers=num_workers))
        lengths = [len(it)]
        next(it)
        lengths.append(len(it))
        return lengths

    plain_lengths, ours = both(run)
    assert ours == plain_lengths == [4, 4]
    for cls in (DataLoader, DataLoaderX):
        with pytest.raises(TypeError):
            len(iter(cls(Stream(4), batch_size=2)))  # no __len__: DataLoader's TypeError too


@pytest.mark.parametrize("persistent", [False, True])
def test_dropping_an_iterator_shuts_its_workers_down_before_del_returns(persistent: bool) -> None:
    # DataLoader's iterator joins its workers in __del__. With the thread outside the DataLoader
    # iterator (waiting to put a batch), dropping ours must do the same, in the caller's thread.
    alive = {}
    for cls in (DataLoader, DataLoaderX):
        loader = cls(Squares(64), batch_size=2, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        del loader  # as in `iter(DataLoader(...))`: the iterator alone keeps the workers
        workers = list(it._workers)
        next(it)
        next(it)
        if cls is DataLoaderX:
            producer = it._thread._producer  # type: ignore[attr-defined]
            # Waiting for room with a batch in hand, not inside the source.
            assert wait_until(lambda p=producer: p.queue.full() and not p.in_source)
        del it
        alive[cls.__name__] = [w.is_alive() for w in workers]
    assert alive["DataLoaderX"] == alive["DataLoader"] == [False, False]


class _SlowItems(Dataset[int]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return i


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_of_an_iterator_dropped_mid_call_are_joined_before_the_caller_joins_them(
    persistent: bool,
) -> None:
    # As PyTorch's test_partial_workers: `del it`, then join the workers. With the thread inside
    # the DataLoader iterator at `del`, its release (and the workers' shutdown with it) came
    # later, in the thread, while the caller was joining them: two threads waiting for one
    # child, and the caller, losing, took it for alive.
    alive: dict[str, list[bool]] = {"DataLoader": [], "DataLoaderX": []}
    for cls in (DataLoader, DataLoaderX):
        for _ in range(3):
            it = iter(cls(_SlowItems(), batch_size=2, num_workers=2, persistent_workers=persistent))
            workers = list(it._workers)
            for _ in range(3):
                next(it)
            if cls is DataLoaderX:
                producer = it._stage._producer  # type: ignore[attr-defined]
                assert wait_until(lambda p=producer: p.in_source)
            del it
            for worker in workers:
                worker.join(30)
                alive[cls.__name__].append(worker.is_alive())
    assert alive["DataLoaderX"] == alive["DataLoader"] == [False] * 6


@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_an_error_raised_to_the_loop_does_not_keep_the_iterator_or_its_workers(
    max_prefetch: int,
) -> None:
    # DataLoader raises a sampler's error without a reference cycle, so `del it` releases its
    # iterator and joins the workers at once, with or without garbage collection. Ours carries
    # the error from where it was caught (in the caller's thread, or in ours) to the loop:
    # nothing on the way may keep it, as its traceback holds the frames, and their locals the
    # DataLoader iterator.
    seen: dict[str, tuple[list[Any], list[bool]]] = {}
    gc.disable()
    try:
        for cls in (DataLoader, DataLoaderX):
            extra = {"max_prefetch": max_prefetch} if cls is DataLoaderX else {}
            loader = cls(
                Squares(12), sampler=FailingSampler(12, 8), batch_size=None, num_workers=2, **extra
            )
            it = iter(loader)
            workers = list(it._workers)
            got: list[Any] = []
            for _ in range(8):
                try:
                    got.append(next(it).tolist())
                except IndexError:
                    got.append("IndexError")
            del it
            seen[cls.__name__] = (got, [worker.is_alive() for worker in workers])
    finally:
        gc.enable()
    assert seen["DataLoaderX"] == seen["DataLoader"]
    assert "IndexError" in seen["DataLoader"][0]
    assert seen["DataLoader"][1] == [False, False]


def test_iter_of_an_iterator_is_itself() -> None:
    it = iter(DataLoaderX(Squares(4), batch_size=2))
    assert iter(it) is it


def test_an_iterators_next_works_every_way_dataloaders_does() -> None:
    def use(loader: DataLoader[Any]) -> list[Any]:
        it = iter(loader)
        method = it.__next__  # bound before the calls, as a loop that caches it would
        got = [next(it), it.__next__(), method(), type(it).__next__(it)]
        got += list(it)  # the rest: one batch, then StopIteration, the same way each time
        with pytest.raises(StopIteration):
            it.__next__()
        return [*as_lists(got), isinstance(it, collections.abc.Iterator)]

    assert use(DataLoaderX(Squares(10), batch_size=2)) == use(DataLoader(Squares(10), batch_size=2))


def test_distributed_sampler_set_epoch_through_loader_sampler() -> None:
    def epoch_order(loader: DataLoader[torch.Tensor], epoch: int) -> list[object]:
        assert isinstance(loader.sampler, DistributedSampler)
        loader.sampler.set_epoch(epoch)
        return as_lists(loader)

    dataset = Squares(16)
    plain_loader = DataLoader(
        dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    )
    ours = DataLoaderX(
        dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    )
    assert epoch_order(ours, 0) == epoch_order(plain_loader, 0)
    assert epoch_order(ours, 1) == epoch_order(plain_loader, 1)
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


# --- copying and pickling ---------------------------------------------------------------------


def _copy_outcome(action: Any, loader: DataLoader[Any]) -> Any:
    try:
        copied = action(loader)
    except Exception as exc:
        return type(exc).__name__
    return as_lists(copied)


@pytest.mark.parametrize("action", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_copies_and_pickles_as_dataloader_after_an_epoch(
    action: Any, persistent: bool
) -> None:
    def run(cls: type[DataLoader[Any]]) -> tuple[Any, Any]:
        loader = cls(
            Squares(6),
            batch_size=2,
            num_workers=2 if persistent else 0,
            persistent_workers=persistent,
        )
        before = _copy_outcome(action, loader)
        as_lists(loader)
        try:
            return before, _copy_outcome(action, loader)
        finally:
            _shut(loader)

    plain_record, ours = both(run)
    assert ours == plain_record
    assert ours[0] == [[[0, 0], [1, 1]], [[2, 4], [3, 9]], [[4, 16], [5, 25]]]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("action", [pickle.dumps, copy.copy, copy.deepcopy])
def test_an_iterator_cannot_be_pickled_or_copied_as_dataloaders(
    action: Callable[[Any], Any], num_workers: int
) -> None:
    for cls in (DataLoader, DataLoaderX):
        it = iter(cls(Squares(4), batch_size=2, num_workers=num_workers))
        next(it)
        with pytest.raises(NotImplementedError, match="cannot be pickled"):
            action(it)
        del it


# --- the caller's torch settings are left alone (FIELD pitfall 18) ----------------------------

_THREADS_SCRIPT = """
import sys, threading, time
import torch
from torch.utils.data import DataLoader
from prefetchx import DataLoaderX
from tests.helpers import Squares

def counts():
    seen = []
    other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    other.start()
    other.join()
    return torch.get_num_threads(), seen[0]

Loader = DataLoaderX if sys.argv[1] == "x" else DataLoader
kwargs = {"mean": (0.0, 0.0), "std": (2.0, 2.0)} if sys.argv[1] == "x" else {}
for num_workers in (0, 2):
    for _ in Loader(Squares(40), batch_size=4, num_workers=num_workers, **kwargs):
        time.sleep(0.002)  # a step long enough for the thread to stay on
    print(num_workers, *counts())
"""


def test_the_callers_intra_op_threads_are_left_alone() -> None:
    # Each loader in a fresh interpreter, with no workers and then with 2: the counts in the
    # caller's thread and in a thread it starts afterwards, after each epoch.
    def counts(which: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _THREADS_SCRIPT, which],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    ours = counts("x")
    assert [line.split()[0] for line in ours] == ["0", "2"]
    assert ours == counts("plain")


# --- typing -----------------------------------------------------------------------------------

_TYPED = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from prefetchx import DataLoaderX

dataset = TensorDataset(torch.zeros(4, 2), torch.zeros(4))

def build() -> None:
    plain = DataLoader(dataset, batch_size=2)
    ours = DataLoaderX(dataset, batch_size=2, max_prefetch=1)
    reveal_type(plain)
    reveal_type(ours)
"""


def test_mypy_infers_the_same_type_parameter_as_for_dataloader(tmp_path: Any) -> None:
    pytest.importorskip("mypy")
    path = tmp_path / "typed.py"
    path.write_text(_TYPED)
    # In a child: mypy keeps millions of objects alive, which slows every later gc pass. It
    # shares the repository's mypy cache: torch's stubs take 25 s to check cold, 2 s from there.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", str(path), "--strict", "--no-error-summary"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = done.stdout
    revealed = [
        line.split("Revealed type is ")[1] for line in out.splitlines() if "Revealed" in line
    ]
    assert len(revealed) == 2, out + done.stderr
    plain_type, ours = revealed
    assert plain_type.startswith('"torch.utils.data.dataloader.DataLoader[')
    assert ours == plain_type.replace(
        "torch.utils.data.dataloader.DataLoader[", "prefetchx._loader.DataLoaderX["
    )
    assert "Need type annotation" not in out
    assert [line for line in out.splitlines() if "error:" in line] == []
    assert done.returncode == 0


# --- soak: random use of several iterators at once, both classes, one script --------------------


def _any_worker(record: list[Any]) -> list[Any]:
    return [(re.sub(r"worker process \d+", "worker process N", str(v)), w) for v, w in record]


def _soak(cls: type[DataLoader[Any]], seed: int, num_workers: int, persistent: bool) -> Any:
    """A seeded random script of iterator operations; the log of everything observed, and the
    loader and its last-started iterator for the caller to inspect."""
    script = torch.Generator().manual_seed(seed)

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=script))

    loader = cls(
        Squares(30, fail_at=17),
        batch_size=4,
        shuffle=True,
        num_workers=num_workers,
        persistent_workers=persistent,
    )
    live: list[Any] = []
    log: list[Any] = []
    last: Any = None
    for _ in range(40):
        op = pick(10)
        if op < 2 or not live:
            last = iter(loader)
            live.append(last)
            log.append(("iter", len(live)))
        elif op < 8:
            k = pick(len(live))
            log.append(("next", k, outcomes(live[k], limit=1 + pick(3))))
        elif op < 9:
            k = pick(len(live))
            gone = live.pop(k)
            log.append(("drop", k))
            if gone is last:
                last = None
            del gone
        else:
            log.append(("rand", torch.rand(1).item()))
    return log, loader, last


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (2, True)], ids=["w0", "w2", "w2p"]
)
def test_soak_random_use_of_several_iterators(
    seed: int, num_workers: int, persistent: bool
) -> None:
    kept: list[Any] = []

    def run(cls: type[DataLoader[Any]]) -> Any:
        log, loader, last = _soak(cls, seed, num_workers, persistent)
        kept.append((loader, last))
        return log

    plain_log, ours = both(run)
    assert ours == plain_log
    (plain_loader, _), (loader, last) = kept
    try:
        if last is not None:  # the state describes the iterator started last: resume its rest
            state = loader.state_dict()
            rng = torch.get_rng_state()  # a checkpoint saves it beside the loader's state
            rest = outcomes(last)
            resumed = DataLoaderX(
                Squares(30, fail_at=17), batch_size=4, shuffle=True, num_workers=num_workers
            )
            resumed.load_state_dict(state)
            torch.set_rng_state(rng)
            # Which worker made the failed batch depends on where the epoch started.
            assert _any_worker(outcomes(iter(resumed))) == _any_worker(rest)
    finally:
        _shut(plain_loader)
        _shut(loader)


class _Mixing:
    """A collate function with timm's ``FastCollateMixup`` switch: mixed batches are negated."""

    def __init__(self) -> None:
        self.mixup_enabled = True

    def __call__(self, items: list[int]) -> torch.Tensor:
        batch = torch.tensor(items)
        return -batch if self.mixup_enabled else batch


def test_timm_turns_mixup_off_through_the_loader() -> None:
    loader = DataLoaderX(range(4), batch_size=2, collate_fn=_Mixing(), max_prefetch=1)
    assert [b.tolist() for b in loader] == [[0, -1], [-2, -3]]
    # timm's train.py, once epoch >= mixup_off_epoch, with a prefetching loader:
    if loader.mixup_enabled:
        loader.mixup_enabled = False
    assert loader.collate_fn.mixup_enabled is False
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    plain = DataLoaderX(range(4), batch_size=2)  # no switch: off, and setting it does nothing
    assert plain.mixup_enabled is False
    plain.mixup_enabled = True
    assert plain.mixup_enabled is False


def test_switching_between_thread_and_loop_at_every_window_keeps_dataloaders_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hand-over in both directions, about as often as it can happen. The batches, the
    # error in its place, the order and the draws from the loader's generator stay DataLoader's.
    monkeypatch.setattr("prefetchx._pipeline.Decision", Switching)
    got: dict[str, Any] = {}
    for cls in (DataLoader, DataLoaderX):
        generator = torch.Generator().manual_seed(7)
        loader = cls(Squares(60, fail_at=17), batch_size=3, shuffle=True, generator=generator)
        epochs = [outcomes(iter(loader)) for _ in range(2)]
        got[cls.__name__] = (epochs, generator.get_state())
    assert got["DataLoaderX"][0] == got["DataLoader"][0]
    assert ("ValueError: boom at index 17", []) in got["DataLoader"][0][0]
    assert torch.equal(got["DataLoaderX"][1], got["DataLoader"][1])


class _Timed(Dataset[int]):
    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.seconds)
        return i


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("reseed", [True, False])
def test_leaving_an_epoch_early_draws_nothing_more_from_the_loaders_generator(
    persistent: bool, reseed: bool
) -> None:
    # 24 batches, 2 workers (their index queues 4 batches ahead), items of 30 ms: the sampler
    # reaches its end, where RandomSampler draws a whole permutation from the loader's
    # generator, in the call for batch 21. A thread running ahead of a loop that leaves after
    # batch 19 must not make that draw: DataLoader does not. Before, it did where it got
    # there before the next epoch began, and raced with a reseed right after the break.
    def epochs(kind: Any) -> list[list[int]]:
        generator = torch.Generator().manual_seed(0)
        loader = kind(
            _Timed(24, 0.03),
            batch_size=1,
            shuffle=True,
            num_workers=2,
            persistent_workers=persistent,
            generator=generator,
        )
        out: list[list[int]] = []
        for epoch in range(3):
            seen = []
            for i, batch in enumerate(loader):
                seen.append(int(batch))
                if epoch == 0 and i + 1 == 19:
                    break
            if epoch == 0:
                time.sleep(0.3)  # whatever a thread ran ahead into, it has done by now
            if reseed:
                generator.manual_seed(epoch + 1)
            out.append(seen)
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        return out

    assert epochs(DataLoaderX) == epochs(DataLoader)
