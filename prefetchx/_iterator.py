"""`PrefetchIterator`: one iterator of a DataLoaderX or a Prefetcher, and its whole lifecycle.

A DataLoader hands out independent iterators: each ``iter()`` makes a new one (`zip(dl, dl)`,
nested loops and a validation pass over the training loader each get their own epoch), except
with persistent workers, where DataLoader keeps one iterator and calls its ``_reset`` at each
``iter()``. DataLoaderX keeps exactly that: DataLoader's ``__iter__`` decides, and each iterator it
makes is one of these, wrapping the DataLoader iterator made on the calling thread with stages of
its own.

The iterator faces the loop, so it is also the stall meter: it times each ``next()`` and the step
between two, counts every outcome it hands over into the epoch's `EpochStats` (which outlive the
iterator: a state taken after any exit counts what the loop received), and every `WINDOW`
batches hands the loop's pace to the loader's `Decision`, then switches the thread stage to the
mode it wants.

Lifecycle of one iterator:

* made: nothing runs yet; the DataLoader iterator exists (workers started, their index queues
  primed, as DataLoader does at ``iter()``).
* first ``next()``: the first batch is made in the caller's thread, then the thread starts,
  unless the loader's last epochs found the loop faster without it (see `prefetchx._choose`).
* running: each ``next()`` hands over the next outcome, a batch or the exception raised in its
  place; an exception does not end the epoch.
* ended: the DataLoader iterator raised `StopIteration`; so does every later ``next()``.
* closed (`close`, a ``with`` block): the thread is stopped and waited for, bounded, and the
  DataLoader iterator released unless the loader keeps it (persistent workers).
* dropped (garbage collection, an early ``break``): the thread is asked to stop, and never
  waited for; a DataLoader iterator it is not inside is released then, and shuts its workers
  down in the dropping thread, as DataLoader's own does; where the thread is inside it, its
  workers are shut down there all the same (a worker busy over 1 s is left to DataLoader's
  shutdown when the thread lets go), and the thread is woken to let go. An iterator kept for
  persistent workers is released too: its loader, which kept it, is gone.
* reset (persistent workers only, DataLoader calls ``_reset``): the old epoch's thread is stopped
  and waited for, bounded, before the DataLoader iterator is reset on the calling thread; a
  thread still inside it after the wait makes the reset fail with `RuntimeError` rather than
  reset an iterator another thread is using. Then a new epoch starts as above.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, Generic, TypeVar

from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from prefetchx import _engine
from prefetchx._meter import Meter
from prefetchx._pipeline import Pipeline
from prefetchx._producer import describe
from prefetchx._resume import DatasetSnapshots, Position
from prefetchx._stats import EpochStats, Tally

T = TypeVar("T")


class Epoch:
    """What the loader reports of one epoch, also after its iterator is gone."""

    __slots__ = ("position", "snapshots", "stats", "tally")

    def __init__(self, position: Position | None = None) -> None:
        self.stats = EpochStats()
        self.tally = Tally(self.stats)
        """The outcomes the loop received (one wait sample each), and whether the epoch ended."""
        self.position = position
        """Where the sampler is, for `DataLoaderX.state_dict`; ``None`` without a sampler."""
        self.snapshots: DatasetSnapshots | None = None
        """An IterableDataset's own states after each batch, where they can be known."""


class PrefetchIterator(_BaseDataLoaderIter, Iterator[T], Generic[T]):
    """The iterator `iter()` returns for a `DataLoaderX` or a `Prefetcher`.

    It behaves as the DataLoader iterator it wraps (``next()``, ``len()``, not picklable), with
    the prefetch stages behind ``next()``. ``close()`` and ``with`` stop its thread; see the
    module docstring for its whole lifecycle. It is a DataLoader iterator for ``isinstance``
    (`_BaseDataLoaderIter`, whose ``__init__`` it does not run): frameworks that leave DataLoader
    iterators out of what they copy or pickle (Lightning's ``CombinedLoader``) leave it out too.
    """

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
        own_calls: int = 0,
    ) -> None:
        self._source: Iterator[T] | None = source
        self._feed = feed  # what the stages pull from, when not the source itself
        self._pipeline = pipeline
        self._keep_source = keep_source
        self._recorder = recorder  # the DataLoader iterator's index sampler, for _reset
        self._length: int | None = None
        self._batches = length  # the source's len() when the source itself has none
        self._own_calls = own_calls  # the epoch's last calls the loop makes itself
        self._start(epoch)

    def _start(self, epoch: Epoch) -> None:
        source = self._source
        assert source is not None  # started only with a source
        self.epoch = epoch
        stats = epoch.stats
        # DataLoader's multiprocessing iterator, used by nobody else, may be abandoned by a
        # thread stuck in it once the stage is left (see prefetchx._engine.Reaper).
        reapable = not self._keep_source and isinstance(source, _MultiProcessingDataLoaderIter)
        length = self._batches if self._batches is not None else length_of(source)
        if length is not None and epoch.position is not None:
            length = max(0, length - epoch.position.skipped)  # a resumed sampler skips these
        # The thread asks for at most this many batches: the calls that end the epoch, and what
        # the source does then (a sampler's last draw from the loader's generator, a loader that
        # advances its own epoch), are the loop's own, made only if the loop makes them.
        limit = None if length is None else max(0, length - self._own_calls)
        feed = self._feed if self._feed is not None else source
        thread, stage = self._pipeline.build(
            feed, stats, reapable=reapable, limit=limit, source_name=describe(source)
        )
        self._thread = thread
        self._stage = stage
        decision = self._pipeline.decision if thread.max_prefetch else None
        if decision is not None:
            thread.switch(decision.wanted)
            stats.parked_because = "" if decision.threaded else decision.note
        self._meter = Meter(stats, thread, stage, decision, epoch.tally, length)

    def __iter__(self) -> PrefetchIterator[T]:
        return self

    def __next__(self) -> T:
        # The meter holds what a batch touches, in slots: this class's __getattr__ (the
        # DataLoader iterator's private attributes, read through) would slow every one.
        meter = self._meter
        if meter.lent is None:
            return meter.next()  # type: ignore[no-any-return]  # an item of the source
        return meter.lent_next()  # type: ignore[no-any-return]  # an item of the source

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
        return self._thread.producer_alive

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        """DataLoader's hook for persistent workers: the next epoch over the same iterator."""
        self._meter.return_lent()
        self._stage.close()
        if self._thread.producer_alive:
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
        self._meter.return_lent()
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
    def _num_yielded(self) -> int:  # type: ignore[override]  # DataLoader's is a plain int
        """DataLoader's count of the batches handed to the loop this epoch (not the errors):
        the epoch's own count, read-only."""
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
        # Collected: nothing else uses its DataLoader iterator (a kept one's loader is gone too).
        # The thread is asked to stop; a DataLoader iterator it is not inside is released now,
        # and shuts its workers down here, as DataLoader's own dropped iterator does. Where the
        # thread is inside it, waiting for a worker's batch, its workers are shut down here all
        # the same rather than after that call (which made an exception in the loop reach the
        # caller a batch's time late), and the thread is woken to let go.
        state = self.__dict__
        stage = state.get("_stage")
        source = state.get("_source")
        if stage is not None and isinstance(source, _MultiProcessingDataLoaderIter):
            self._thread.drop()
            if self._thread.inside_source and not sys.is_finalizing():
                shut_down_under_thread(source)

    def __enter__(self) -> PrefetchIterator[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> Any:
        # As DataLoader's own iterators: an iterator with a thread and workers cannot be pickled.
        raise NotImplementedError("{} cannot be pickled", type(self).__name__)


def shut_down_under_thread(source: Any) -> None:
    """Shut down the workers of a dropped DataLoader iterator that a stopped thread is inside,
    waiting for a worker's batch, as DataLoader's own shutdown would, from the calling thread.

    First what DataLoader's ``_shutdown_workers`` does before its joins: the done event set, and
    each worker sent its last index, so that it exits after the item it is making. Then the
    joins, here, `LET_GO_WAIT` at most; where every worker has exited, DataLoader's shutdown
    proper (its queues, its pin thread), and the thread's wait on the results ended with a value
    DataLoader cannot take, so that it fails there and ends (its outcomes are no one's now). A
    worker still busy (an item of many seconds) leaves it all to the thread, which lets go of the
    iterator when its call returns, and DataLoader's shutdown runs then. Nothing where this
    torch's iterator lacks these parts, or is shut down already: the thread then ends when its
    call returns, or is reaped.
    """
    parts = ("_workers_done_event", "_mark_worker_as_unavailable", "_workers_status", "_workers")
    if not all(hasattr(source, part) for part in parts) or getattr(source, "_shutdown", True):
        return
    done, mark = source._workers_done_event, source._mark_worker_as_unavailable
    status, workers = source._workers_status, source._workers
    done.set()
    for worker_id, active in enumerate(list(status)):
        if active or getattr(source, "_persistent_workers", False):
            mark(worker_id, shutdown=True)
    deadline = time.monotonic() + _engine.LET_GO_WAIT
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    if any(worker.is_alive() for worker in workers):
        return  # busy longer: left to the thread, which lets go when its call returns
    source._shutdown_workers()
    with contextlib.suppress(Exception):  # where this fails, the thread is reaped (see above)
        _wake(getattr(source, "_data_queue", None))


def _wake(results: Any) -> None:
    """End a wait on DataLoader's result queue with ``None``, which it cannot unpack.

    Its pin thread's ``queue.Queue`` takes it as any value. Its workers' multiprocessing queue is
    written to directly, as its feeder thread would: a put would start that feeder thread in
    this process, which cannot start while the interpreter exits.
    """
    if isinstance(results, queue.Queue):
        results.put_nowait(None)
    elif hasattr(results, "_writer"):
        results._writer.send_bytes(ForkingPickler.dumps(None))


def loop_calls(loader: Any) -> int:
    """How many of an epoch's last calls of a DataLoader's iterator the loop makes itself,
    so that the thread never makes the call in which the sampler reaches its end.

    There a shuffling sampler draws from the loader's ``generator`` once more (torch's
    `RandomSampler` draws a whole permutation), and a thread that made that call for a loop
    that then left the epoch early would change every later epoch, or race with the caller
    reseeding the generator. DataLoader asks its index sampler for one index batch per call;
    with workers it asks for ``prefetch_factor * num_workers`` more when the iterator is made
    (the workers' index queues), so draw ``d`` comes in call ``d - lead``, or at ``iter()``. The
    sampler ends at the draw after the last index batch, or, where the last batch may be
    short and kept (`ends_with_last`), at the last one. ``0`` where there is no sampler to end
    (an IterableDataset) or its end comes at ``iter()``.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return 0
    try:
        batches = len(loader)
    except TypeError:
        return 0
    lead = loader.num_workers * (loader.prefetch_factor or 0) if loader.num_workers > 0 else 0
    end_draw = batches + 1 - (1 if ends_with_last(loader) else 0)
    if end_draw <= lead:
        return 0  # drawn while the iterator was made, in the caller's thread
    return batches - (end_draw - lead - 1)


def ends_with_last(loader: Any) -> bool:
    """Whether making a DataLoader's last batch may run its sampler to its end: torch's
    `BatchSampler` whose last batch is short and kept, and any other batch sampler, which may
    fill its last batch only when its sampler has ended."""
    batches = loader.batch_sampler
    if batches is None:
        return False  # an index a batch: the end comes with the draw after the last
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
