"""`Prefetcher`: both stages over any re-iterable of batches, such as a loader a framework made."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from torch.utils.data import DataLoader

from prefetchx import _engine, _hooks, _options
from prefetchx._iterator import Epoch, PrefetchIterator, length_of, loop_calls
from prefetchx._options import PrefetchOptions
from prefetchx._pipeline import Pipeline
from prefetchx._producer import settle
from prefetchx._stats import EpochStats

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """The thread stage and the device stage over any iterable of batches.

    For loaders you cannot make a `DataLoaderX`. Each ``iter()`` calls ``iter(iterable)`` on the
    calling thread and returns a new, independent iterator that runs the stages over it, with
    the same arguments, lifecycle and stall meter as `DataLoaderX`. Over a ``DataLoader`` with
    persistent workers, whose ``iter()`` resets the one iterator it keeps, a new ``iter()`` first
    stops the iterators it made before (waiting for their threads, bounded), as DataLoaderX's
    reset does.

    It yields what the iterable yields, epoch by epoch, whatever the step time: when the
    iterable has a ``len()``, the thread asks it for at most that many batches, and the call that
    ends its epoch (and whatever the iterable does then, such as advancing its own epoch) is made
    by your ``next()``, in your thread, as a plain loop would, and only if you make it. A batch
    past its ``len()`` comes through the same stages without the thread.

    What frameworks read from a loader is the iterable's: ``len()``, and any public attribute a
    Prefetcher does not have itself (``dataset``, ``sampler``, ``batch_sampler``, ``batch_size``,
    ``set_epoch``, ...) is read from the iterable.

    A loader accelerate prepared is iterated in your thread, with the stages beneath it instead:
    accelerate looks one batch ahead to know where the epoch ends (gradient accumulation,
    ``gather_for_metrics``), and a thread ahead of it would move that end. The Prefetcher keeps
    a copy of it whose plain `DataLoader` is a `DataLoaderX` with these arguments (see
    `prefetchx.accelerate.add_stages`); the loader you gave is not changed. ``set_epoch``,
    ``end_of_dataloader`` and ``remainder`` are the copy's.

    Args:
        iterable: Where batches come from; iterated once per ``iter()``.
        **options: The prefetch arguments, keyword-only, as `DataLoaderX`'s (``help()`` shows
            them). For accelerate's loader, ``device=None`` means where accelerate puts
            batches; with ``max_prefetch=0`` no batch is made ahead for the device.

    Raises:
        TypeError: An argument has the wrong type, or is none of its arguments (the message
            names the closest one).
        ValueError: An argument has a bad value, or ``device`` does not exist here.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> batches = Prefetcher(DataLoader(range(6), batch_size=4), max_prefetch=1)
        >>> [batch.tolist() for batch in batches], len(batches), batches.batch_size
        ([[0, 1, 2, 3], [4, 5]], 2, 4)
    """

    def __init__(self, iterable: Iterable[T], **options: Any) -> None:
        self.iterable = iterable
        self._latest: Epoch | None = None
        self._live: weakref.WeakSet[PrefetchIterator[T]] = weakref.WeakSet()
        given, _ = _options.split(type(self).__name__, options)
        self._options = PrefetchOptions(**given)
        """The checked options, kept also for a copy over another iterable (a loader skipped
        into)."""
        self._pipeline = Pipeline(self._options)
        self._beneath = _hooks.adapt(iterable, self._options)
        """A framework's loader that must iterate itself (accelerate's, which looks ahead to
        know where the epoch ends), copied with the stages beneath it by an integration; None
        for any other iterable."""

    def __iter__(self) -> Iterator[T]:
        if self._beneath is not None:
            # The framework's own iteration, in this thread; the stages run beneath it.
            return iter(self._beneath.outer)
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
        iterator: PrefetchIterator[T] = PrefetchIterator(
            iter(self.iterable),
            self._pipeline,
            epoch,
            length=length_of(self.iterable),
            own_calls=loop_calls(self.iterable),
        )
        self._latest = epoch
        self._live.add(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]  # TypeError if it has none, as len()

    def __getattr__(self, name: str) -> Any:
        # Only for names not found otherwise: what frameworks read from a loader (its dataset,
        # sampler, batch size, set_epoch, accelerate's end-of-data state) is the loader's.
        beneath = self.__dict__.get("_beneath")
        wrapped = beneath.outer if beneath is not None else self.__dict__.get("iterable")
        if name.startswith("_") or wrapped is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        _hooks.read(self, name)  # a framework may be rebuilding the loader from what it reads
        return getattr(wrapped, name)

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the epoch started last (by ``iter()``), running or not."""
        if self._beneath is not None:
            return self._beneath.loader.stats  # type: ignore[no-any-return]
        return self._latest.stats if self._latest is not None else EpochStats()

    def close(self) -> None:
        """Stop every iterator of this Prefetcher still running, waiting for their threads
        (bounded), and for those of iterators dropped earlier. Idempotent."""
        if self._beneath is not None:
            self._beneath.loader.close()
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


Prefetcher.__init__.__signature__ = _options.signature(Prefetcher.__init__)  # type: ignore[attr-defined]
Prefetcher.__doc__ = _options.document(Prefetcher.__doc__)
