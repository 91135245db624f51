"""Prefetcher: the two stages over an iterable that is not a DataLoaderX."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from prefetchx import Prefetcher
from tests.helpers import Squares, as_lists, outcomes


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("prefetchx-")]


@pytest.mark.parametrize("max_prefetch", [0, 1, 3])
def test_same_batches_every_epoch_and_the_iterables_len(max_prefetch: int) -> None:
    loader = DataLoader(Squares(10), batch_size=4)
    batches = Prefetcher(loader, max_prefetch=max_prefetch)
    assert len(batches) == 3
    for _ in range(2):
        assert as_lists(batches) == as_lists(loader)
    assert batches.stats.batches == 3


def test_normalizes_on_the_cpu_as_dataloaderx_does() -> None:
    images = torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8)
    loader = DataLoader(list(zip(images, range(6), strict=True)), batch_size=3)
    batches = Prefetcher(loader, mean=[10, 20, 30], std=[2, 4, 8], channels_last=True)
    mean = torch.tensor([10.0, 20, 30]).view(1, 3, 1, 1)
    std = torch.tensor([2.0, 4, 8]).view(1, 3, 1, 1)
    for (x, y), (raw, labels) in zip(batches, loader, strict=True):
        assert x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(x, (raw.float() - mean) / std)
        assert torch.equal(y, labels)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterators_are_independent_as_the_loaders(num_workers: int) -> None:
    def run(batches: Any) -> list[Any]:
        return [(a.tolist(), b.tolist()) for a, b in zip(batches, batches, strict=False)]

    torch.manual_seed(0)
    expected = run(DataLoader(Squares(12), batch_size=2, shuffle=True, num_workers=num_workers))
    torch.manual_seed(0)
    loader = DataLoader(Squares(12), batch_size=2, shuffle=True, num_workers=num_workers)
    assert run(Prefetcher(loader)) == expected


def test_over_persistent_workers_a_new_iter_stops_the_previous_thread_first() -> None:
    # DataLoader resets the one iterator it keeps: no thread may still be inside it.
    loader = DataLoader(Squares(40), batch_size=2, num_workers=2, persistent_workers=True)
    batches = Prefetcher(loader, max_prefetch=2)
    try:
        first = iter(batches)
        next(first)
        second = iter(batches)
        assert not first.producer_alive
        assert len(as_lists(second)) == 20
    finally:
        batches.close()
        loader._iterator = None


def test_close_stops_every_iterator_and_the_context_manager_too() -> None:
    batches = Prefetcher(DataLoader(Squares(40), batch_size=2), max_prefetch=2)
    first, second = iter(batches), iter(batches)
    next(first)
    next(second)
    assert _threads() == ["prefetchx-thread"] * 2
    batches.close()
    assert not _threads()
    with Prefetcher(DataLoader(Squares(40), batch_size=2)) as scoped:
        next(iter(scoped))
    assert not _threads()


def test_an_error_does_not_end_the_epoch() -> None:
    batches = Prefetcher(DataLoader(Squares(10, fail_at=5), batch_size=2))
    assert outcomes(iter(batches)) == outcomes(iter(DataLoader(Squares(10, fail_at=5), 2)))


def test_errors_keep_their_type() -> None:
    batches = Prefetcher(DataLoader(Squares(10, fail_at=5), batch_size=2))
    with pytest.raises(ValueError, match="boom at index 5"):
        list(batches)


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="`max_prefetch` must be >= 0, got -1"):
        Prefetcher([], max_prefetch=-1)
    with pytest.raises(TypeError, match="`device_prefetch` must be an int"):
        Prefetcher([], device_prefetch=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        len(Prefetcher(iter([1, 2])))


def test_what_frameworks_read_is_the_loaders() -> None:
    sampler = torch.utils.data.RandomSampler(range(10))
    loader = DataLoader(Squares(10), batch_size=4, sampler=sampler)
    batches = Prefetcher(loader)
    assert batches.dataset is loader.dataset
    assert batches.sampler is sampler
    assert batches.batch_sampler is loader.batch_sampler
    assert (batches.batch_size, batches.drop_last, len(batches)) == (4, False, 3)
    assert not hasattr(batches, "set_epoch")  # as the loader: frameworks test with hasattr
    assert not hasattr(Prefetcher(loader), "_iterator")  # private names stay private
    epochs = _EpochCounting()
    Prefetcher(epochs).set_epoch(7)
    assert epochs.epoch == 7


class _EpochCounting:
    """A loader whose epoch advances when an epoch runs to its end, as accelerate's does."""

    def __init__(self, batches: int = 6, length: int | None = None) -> None:
        self.epoch = 0
        self.batches = batches
        self.length = batches if length is None else length
        self.callers: list[str] = []
        self.ends: list[str] = []
        """The threads each epoch ended in."""

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        shuffle = torch.Generator().manual_seed(self.epoch)
        for batch in torch.randperm(2 * self.batches, generator=shuffle).view(self.batches, 2):
            self.callers.append(threading.current_thread().name)
            yield batch
        self.ends.append(threading.current_thread().name)
        self.epoch += 1


def _epochs(batches: Any, take_len: bool, step_s: float) -> list[list[int]]:
    """Three epochs: each to its end, or only ``len()`` batches, as the Trainer takes them."""
    seen = []
    for _ in range(3):
        iterator = iter(batches)
        steps = range(len(batches)) if take_len else iter(int, 1)
        for _, batch in zip(steps, iterator, strict=False):
            seen.append(batch.tolist())
            time.sleep(step_s)
        del iterator
    return seen


@pytest.mark.parametrize("take_len", [False, True], ids=["to-the-end", "len-batches"])
@pytest.mark.parametrize("step_s", [0.0, 0.003], ids=["short-steps", "long-steps"])
def test_yields_what_the_loader_yields_epoch_by_epoch_whatever_the_step_time(
    take_len: bool, step_s: float
) -> None:
    expected = _epochs(_EpochCounting(), take_len, 0.0)
    assert (expected[:6] == expected[6:12]) is take_len  # the loader's next epoch never began
    source = _EpochCounting()
    assert _epochs(Prefetcher(source, max_prefetch=3), take_len, step_s) == expected
    # The call that ends an epoch is the loop's own, and only when it makes it.
    assert source.ends == ([] if take_len else ["MainThread"] * 3)


def test_batches_past_the_loaders_len_come_through_the_same_stages() -> None:
    images = torch.randint(0, 256, (5, 3, 2, 2), dtype=torch.uint8)

    class Longer(_EpochCounting):
        def __iter__(self) -> Any:
            for image in images:
                self.callers.append(threading.current_thread().name)
                time.sleep(0.002)
                yield image[None]

    source = Longer(batches=5, length=3)
    batches = Prefetcher(source, mean=[1, 2, 3], std=[2, 2, 2], max_prefetch=2)
    got = [x for x in batches]
    assert len(got) == 5
    mean = torch.tensor([1.0, 2, 3]).view(1, 3, 1, 1)
    for x, image in zip(got, images, strict=True):
        torch.testing.assert_close(x, (image[None].float() - mean) / 2)
    assert source.callers[3:] == ["MainThread", "MainThread"]  # past len(): in the loop's thread


def test_an_error_counts_as_one_of_len_batches() -> None:
    loader = DataLoader(Squares(10, fail_at=5), batch_size=2)
    batches = Prefetcher(loader, max_prefetch=4)
    assert outcomes(iter(batches)) == outcomes(iter(loader))
