"""`Prefetcher`: both stages over any re-iterable of batches, such as a loader a framework made."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

import torch

from prefetchx._pipeline import Pipeline, Stage
from prefetchx._stats import EpochStats

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """The thread stage and the device stage over any iterable of batches.

    For loaders you cannot make a `DataLoaderX`, chiefly the one ``accelerate``'s ``prepare``
    returns (it rebuilds every ``DataLoader`` subclass as its own class). Each ``iter()`` calls
    ``iter(iterable)`` on the calling thread and runs the stages over it, with the same
    arguments, lifecycle and stall meter as `DataLoaderX`; ``len()`` is the iterable's.

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

    def __iter__(self) -> Stage:
        self._pipeline.stop()
        return self._pipeline.start(iter(self.iterable))

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]  # TypeError if it has none, as len()

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the current epoch, or of the last one once it has ended."""
        return self._pipeline.stats

    def close(self) -> None:
        """Stop the current epoch's thread. Idempotent; a later ``iter()`` starts afresh."""
        self._pipeline.stop()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
