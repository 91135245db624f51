"""`PrefetchIterator`: one iterator of a DataLoaderX or a Prefetcher, and its whole lifecycle.

A DataLoader hands out independent iterators: each ``iter()`` makes a new one (`zip(dl, dl)`,
nested loops and a validation pass over the training loader each get their own epoch), except
with persistent workers, where DataLoader keeps one iterator and calls its ``_reset`` at each
``iter()``. DataLoaderX keeps exactly that: DataLoader's ``__iter__`` decides, and each iterator it
makes is one of these, wrapping the DataLoader iterator made on the calling thread with stages of
its own.

Lifecycle of one iterator:

* made: nothing runs yet; the DataLoader iterator exists (workers started, their index queues
  primed, as DataLoader does at ``iter()``).
* first ``next()``: the first batch is made in the caller's thread, then the stages' thread
  starts (see `ThreadStage`).
* running: each ``next()`` hands over the next outcome, a batch or the exception raised in its
  place; an exception does not end the epoch.
* ended: the DataLoader iterator raised `StopIteration`; so does every later ``next()``.
* closed (`close`, a ``with`` block): the thread is stopped and waited for, bounded, and the
  DataLoader iterator released unless the loader keeps it (persistent workers).
* dropped (garbage collection, an early ``break``): the thread is asked to stop; only a
  DataLoader iterator with workers is waited for (at most 1 s, for the call the thread is in)
  and released then, in the dropping thread, so that its workers shut down there, as
  DataLoader's do. An iterator kept for persistent workers is released too: its loader, which
  kept it, is gone.
* reset (persistent workers only, DataLoader calls ``_reset``): the old epoch's thread is stopped
  and waited for, bounded, before the DataLoader iterator is reset on the calling thread; a
  thread still inside it after the wait makes the reset fail with `RuntimeError` rather than
  reset an iterator another thread is using. Then a new epoch starts as above.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Generic, TypeVar, cast

from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from prefetchx import _engine
from prefetchx._pipeline import Pipeline, Stage
from prefetchx._resume import DatasetSnapshots, Position
from prefetchx._stats import EpochStats, Tally

T = TypeVar("T")


class Epoch:
    """What the loader reports of one epoch, also after its iterator is gone."""

    __slots__ = ("position", "snapshots", "stats", "tally")

    def __init__(self, position: Position | None = None) -> None:
        self.stats = EpochStats()
        self.tally = Tally(self.stats.wait)
        self.position = position
        """Where the sampler is, for `DataLoaderX.state_dict`; ``None`` without a sampler."""
        self.snapshots: DatasetSnapshots | None = None
        """An IterableDataset's own states after each batch, where they can be known."""


class PrefetchIterator(Iterator[T], Generic[T]):
    """The iterator `iter()` returns for a `DataLoaderX` or a `Prefetcher`.

    It behaves as the DataLoader iterator it wraps (``next()``, ``len()``, not picklable), with
    the prefetch stages behind ``next()``. ``close()`` and ``with`` stop its thread; see the
    module docstring for its whole lifecycle.

    Over anything but DataLoader's worker processes, the iterator is a `_Chained`, whose
    ``next()`` runs no Python of its own; over workers (the only iterators DataLoader resets),
    ``next()`` is a method, which costs nothing next to a batch from a worker.
    """

    def __new__(cls, source: Iterator[T], *args: Any, **kwargs: Any) -> PrefetchIterator[T]:
        if cls is PrefetchIterator and not isinstance(source, _MultiProcessingDataLoaderIter):
            parts = _Parts()
            chained = cast(_Chained[T], _Chained.from_iterable(parts))  # typeshed: a chain
            chained._parts = parts
            return chained  # initialized by __init__, as an instance of the class called
        return super().__new__(cls)

    def __init__(
        self,
        source: Iterator[T],
        pipeline: Pipeline,
        epoch: Epoch,
        *,
        keep_source: bool = False,
        recorder: Any = None,
        feed: Iterator[T] | None = None,
        length: int | None = None,
        own_last: bool = False,
    ) -> None:
        self._source: Iterator[T] | None = source
        self._feed = feed  # what the stages pull from, when not the source itself
        self._pipeline = pipeline
        self._keep_source = keep_source
        self._recorder = recorder  # the DataLoader iterator's index sampler, for _reset
        self._length: int | None = None
        self._batches = length  # the source's len() when the source itself has none
        self._own_last = own_last  # the loop makes the epoch's last batch (see ends_with_last)
        self._start(epoch)

    def _start(self, epoch: Epoch) -> None:
        assert self._source is not None  # started only with a source
        self.epoch = epoch
        # DataLoader's multiprocessing iterator, used by nobody else, may be abandoned by a
        # thread stuck in it once the stage is left (see prefetchx._engine.Reaper).
        reapable = not self._keep_source and isinstance(
            self._source, _MultiProcessingDataLoaderIter
        )
        feed = self._feed if self._feed is not None else self._source
        # The thread asks for at most len() batches: the call that ends the epoch, and what the
        # source does then (a sampler's last draw from the loader's generator, a loader that
        # advances its own epoch), is the loop's own, made only if the loop makes it.
        length = self._batches if self._batches is not None else length_of(self._source)
        if length is not None and epoch.position is not None:
            length = max(0, length - epoch.position.skipped)  # a resumed sampler skips these
        if length is not None and self._own_last:
            length = max(0, length - 1)
        stage = self._pipeline.build(feed, epoch.stats, reapable=reapable, limit=length)
        epoch.tally = stage.tally
        self._stage: Stage = stage
        self._connect(stage)

    def _connect(self, stage: Stage) -> None:
        """Hand out the outcomes of ``stage``, the epoch's: here by ``next()`` on it (below),
        which times every batch; a batch from DataLoader's workers costs far more than that."""

    def __iter__(self) -> PrefetchIterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._stage)  # type: ignore[no-any-return]  # an item of the source

    def __len__(self) -> int:
        source = self._source
        if source is None:
            if self._length is None:
                raise TypeError("prefetchx: this iterator is closed and its source had no len()")
            return self._length
        return len(source)  # type: ignore[arg-type]  # TypeError if it has none, as len()

    @property
    def stats(self) -> EpochStats:
        """The stall meter of this iterator's current epoch."""
        return self.epoch.stats

    @property
    def producer_alive(self) -> bool:
        """Whether the epoch's background thread is still running."""
        return self._stage.producer_alive

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        """DataLoader's hook for persistent workers: the next epoch over the same iterator."""
        stage = self._stage
        stage.close()
        if stage.producer_alive:
            # Resetting the iterator under a thread that still calls next() on it would mix two
            # epochs' batches; refuse, and refuse again at the next iter() until it has left.
            raise RuntimeError(
                f"prefetchx: the previous epoch's thread is still inside the DataLoader iterator "
                f"after {_engine.JOIN_TIMEOUT:g} s, and persistent_workers=True shares that "
                "iterator between epochs, so the next epoch cannot start safely. Is the dataset "
                "blocked? loader.close() releases the workers; the next iter() then starts new "
                "ones."
            )
        source = self._source
        begin = getattr(loader, "_begin_epoch", None)
        if source is None or begin is None:
            raise RuntimeError("prefetchx: this iterator cannot be reset")
        # The loader is passed in, not kept: DataLoader's iterators hold no reference to their
        # loader, so dropping a loader shuts its persistent workers down at once.
        epoch, building = begin(self._recorder, draws_base_seed=False)
        with building:
            source._reset(loader, first_iter)  # type: ignore[attr-defined]  # DataLoader's own
        self._start(epoch)

    def close(self) -> None:
        """Stop this iterator's thread, waiting for it (bounded), and drop what it holds.

        Idempotent; ``next()`` raises `StopIteration` afterwards. The DataLoader iterator is
        released, so its workers shut down, unless the loader keeps it for persistent workers.
        """
        self._stage.close()
        if not self._keep_source and self._source is not None:
            try:
                self._length = len(self._source)  # type: ignore[arg-type]
            except TypeError:
                self._length = None
            self._source = None

    def __getattr__(self, name: str) -> Any:
        # Only for names not found otherwise: DataLoader's private iterator attributes (its
        # workers, queues, pin thread) are read from the DataLoader iterator behind the stages.
        source = self.__dict__.get("_source")
        if name.startswith("_") and not name.startswith("__") and source is not None:
            return getattr(source, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def _num_yielded(self) -> int:
        """DataLoader's count of the batches handed to the loop this epoch (not the errors)."""
        return self.epoch.stats.batches

    def _shutdown_workers(self) -> None:
        """DataLoader's own shutdown, after this iterator's thread has left the iterator."""
        self.close()
        source = self.__dict__.get("_source")
        shutdown = getattr(source, "_shutdown_workers", None)
        if shutdown is not None and not self.producer_alive:
            shutdown()

    def _abandon(self) -> None:
        """The loader lets go of the iterator it kept for persistent workers: close it for good."""
        self._keep_source = False
        if isinstance(self._source, _MultiProcessingDataLoaderIter):
            self._stage.abandon()
        self.close()

    def __del__(self) -> None:
        # Collected: so is whatever kept its DataLoader iterator for persistent workers (the
        # loader holds this iterator while it keeps it). Nothing else uses that iterator now:
        # its workers shut down where the loop dropped this, as DataLoader's would.
        state = self.__dict__
        stage = state.get("_stage")
        source = state.get("_source")
        kept = state.get("_keep_source") and isinstance(source, _MultiProcessingDataLoaderIter)
        if kept and stage is not None:
            stage.abandon()

    def __enter__(self) -> PrefetchIterator[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> Any:
        # As DataLoader's own iterators: an iterator with a thread and workers cannot be pickled.
        raise NotImplementedError("{} cannot be pickled", type(self).__name__)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Not `itertools.chain`'s (a `_Chained`), which would copy the iterator's parts.
        return self.__getstate__()


class _Parts:
    """Where a `_Chained` iterator takes its parts from: its stage's, once it has one."""

    __slots__ = ("stage_parts",)

    def __init__(self) -> None:
        self.stage_parts: Iterator[Iterator[Any]] | None = None

    def __iter__(self) -> _Parts:
        return self

    def __next__(self) -> Iterator[Any]:
        parts = self.stage_parts
        if parts is None:
            raise StopIteration
        return next(parts)


class _Chained(itertools.chain, PrefetchIterator[T]):  # type: ignore[type-arg]  # chain's own
    """A `PrefetchIterator` whose ``next()`` is `itertools.chain`'s, over its stage's parts
    (`ThreadStage.parts`): the stage itself, which times each batch, and the counted windows
    of a loop too fast to time each batch, which run no Python of prefetchx's between the loop
    and the source. Even a C-level hop a batch from the iterator to a chain it held cost the
    no-work loop about 0.4 us of 38 (1%, on the 2-core VM with ``benchmarks/no_work.py``).

    A window lets go of the source once it is run through, and `close` runs it through (see
    `ThreadStage._open`), so a close releases the source at once, also inside a window, and
    also while a loop keeps the iterator's ``__next__``. DataLoader never resets one: it
    resets only its worker processes' iterators.
    """

    _parts: _Parts

    def _connect(self, stage: Stage) -> None:
        if self._parts.stage_parts is not None:
            raise RuntimeError("prefetchx: this iterator cannot be reset")
        self._parts.stage_parts = stage.parts()


def ends_with_last(loader: Any) -> bool:
    """Whether making a DataLoader's last batch may run its sampler to its end, where a
    shuffling sampler draws from the loader's ``generator`` once more (torch's `RandomSampler`).

    So it is where a batch sampler fills its last batch only when its sampler has ended: torch's
    `BatchSampler` whose last batch is short and kept, and any other batch sampler, which may.
    The loop then makes the last batch itself, so that an epoch it leaves early never makes
    that draw, as with DataLoader. Not with workers: DataLoader asks its sampler for indices
    ahead of the loop there itself, and no thread can keep that exact.
    """
    if not isinstance(loader, DataLoader) or loader.num_workers > 0:
        return False
    batches = loader.batch_sampler
    if batches is None or isinstance(loader.dataset, IterableDataset):
        return False  # an index a batch, or none: the end comes with the call after the last
    if type(batches) is not BatchSampler:
        return True
    if batches.drop_last:
        return False
    try:
        return len(batches.sampler) % batches.batch_size != 0  # type: ignore[arg-type]
    except TypeError:
        return True


def length_of(source: Any) -> int | None:
    """``len(source)``, or ``None`` where it has none."""
    try:
        return len(source)
    except TypeError:
        return None
