"""Prefetcher: the two stages over an iterable that is not a DataLoaderX."""

from __future__ import annotations

import threading
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
