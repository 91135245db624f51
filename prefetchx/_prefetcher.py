"""`Prefetcher`: both stages over any re-iterable of batches, such as a loader a framework made."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader

from prefetchx import _engine
from prefetchx._iterator import Epoch, PrefetchIterator
from prefetchx._pipeline import Pipeline
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import settle

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """The thread stage and the device stage over any iterable of batches.

    For loaders you cannot make a `DataLoaderX`, chiefly the one ``accelerate``'s ``prepare``
    returns (it rebuilds every ``DataLoader`` subclass as its own class). Each ``iter()`` calls
    ``iter(iterable)`` on the calling thread and returns a new, independent iterator that runs
    the stages over it, with the same arguments, lifecycle and stall meter as `DataLoaderX`;
    ``len()`` is the iterable's. Over a ``DataLoader`` with persistent workers, whose ``iter()``
    resets the one iterator it keeps, a new ``iter()`` first stops the iterators it made before
    (waiting for their threads, bounded), as DataLoaderX's reset does.

    Args:
        iterable: Where batches come from; iterated once per ``iter()``.
        max_prefetch: Batches the background thread keeps ready; ``0`` runs no thread.
        device: Where batches go: ``None`` for the current accelerator if there is one.
        mean: Per-channel means of the input, in its units as collated.
        std: Per-channel standard deviations; ``(x - mean) / std``.
        dtype: Floating dtype of the input after normalization.
        channels_last: Return a 4-D input in channels_last memory format.
        input_key: Which element of a batch is the input.
        device_prefetch: Batches in flight on the device besides the caller's.
        non_blocking: Asynchronous copies (CUDA, from pinned memory).

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument has a bad value, or ``device`` does not exist here.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> batches = Prefetcher(DataLoader(range(6), batch_size=4), max_prefetch=1)
        >>> [batch.tolist() for batch in batches], len(batches)
        ([[0, 1, 2, 3], [4, 5]], 2)
    """

    def __init__(
        self,
        iterable: Iterable[T],
        *,
        max_prefetch: int = 2,
        device: str | torch.device | int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
        input_key: int | str = 0,
        device_prefetch: int = 1,
        non_blocking: bool = True,
    ) -> None:
        self.iterable = iterable
        self._latest: Epoch | None = None
        self._live: weakref.WeakSet[PrefetchIterator[T]] = weakref.WeakSet()
        self._pipeline = Pipeline(
            max_prefetch=max_prefetch,
            device=device,
            mean=mean,
            std=std,
            dtype=dtype,
            channels_last=channels_last,
            input_key=input_key,
            device_prefetch=device_prefetch,
            non_blocking=non_blocking,
        )

    def __iter__(self) -> PrefetchIterator[T]:
        if _keeps_one_iterator(self.iterable):
            # iter() will reset the iterator our earlier iterators' threads may still be in.
            for earlier in list(self._live):
                earlier.close()
                if earlier.producer_alive:
                    raise RuntimeError(
                        "prefetchx: an earlier iterator's thread is still inside the "
                        "DataLoader iterator, which persistent workers share between epochs; "
                        "the next epoch cannot start safely. Is the dataset blocked?"
                    )
        epoch = Epoch()
        iterator: PrefetchIterator[T] = PrefetchIterator(iter(self.iterable), self._pipeline, epoch)
        self._latest = epoch
        self._live.add(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]  # TypeError if it has none, as len()

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the epoch started last (by ``iter()``), running or not."""
        return self._latest.stats if self._latest is not None else EpochStats()

    def close(self) -> None:
        """Stop every iterator of this Prefetcher still running, waiting for their threads
        (bounded), and for those of iterators dropped earlier. Idempotent."""
        for iterator in list(self._live):
            iterator.close()
        settle(_engine.JOIN_TIMEOUT)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _keeps_one_iterator(iterable: Any) -> bool:
    """Whether ``iter(iterable)`` resets one shared iterator (a DataLoader's persistent workers)."""
    return bool(
        isinstance(iterable, DataLoader) and iterable.persistent_workers and iterable.num_workers
    )
