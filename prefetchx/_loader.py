"""`DataLoaderX`: a `DataLoader` whose iterator chains the prefetch stages."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import multiprocessing
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from prefetchx import _engine, _hooks, _options
from prefetchx._iterator import Epoch, PrefetchIterator, loop_calls
from prefetchx._options import PrefetchOptions
from prefetchx._pipeline import Pipeline
from prefetchx._producer import settle
from prefetchx._resume import (
    IndexRecorder,
    Position,
    between_epochs,
    describe,
    has_own_state,
    inside_epoch,
    is_iterable,
    random_generators,
    worker_plans,
)
from prefetchx._snapshots import DatasetSnapshots
from prefetchx._state import Saved
from prefetchx._stats import EpochStats
from prefetchx._workers import Ends, TaggingCollate, WorkerInit, WorkersIter

T_co = TypeVar("T_co", covariant=True)


class DataLoaderX(DataLoader[T_co]):
    """A drop-in `torch.utils.data.DataLoader` that prepares the next batches in the background.

    It takes every `DataLoader` argument, positional or keyword, with the same names and defaults,
    and yields the same batches in the same order. Its iterator runs the DataLoader iterator ahead
    in a background thread named ``prefetchx-thread``, so the next batch is produced while the
    caller trains on this one.

    A thread helps only where it hides more than it costs: it runs from the second batch, and
    the loader parks it where the loop is measurably faster without it (batches are then made
    in the caller's thread, in order, as `DataLoader` makes them), after a probe that costs at
    most 2% of the loop's time; an epoch starts in the mode the last one left.
    ``loader.stats`` is the stall meter of the epoch started last.

    With an accelerator (``device``, or the current accelerator when ``device`` is ``None``), a
    second stage copies the next ``device_prefetch`` batches to it on a side stream while the
    caller trains, and normalizes the input there; the Design page of the docs ("Device stage:
    streams and fences") states the stream invariants.
    On the CPU the same normalization runs where the batch is made instead: in the background
    thread while it runs.

    Iterators, as with `DataLoader`: each ``iter()`` returns a new, independent iterator
    (``zip(loader, loader)``, nested loops, a validation pass inside the training loop each get
    their own epoch); with ``persistent_workers=True`` DataLoader keeps one iterator and resets it
    at each ``iter()``. The DataLoader iterator is made on the calling thread at ``iter()``; the
    first batch of an epoch is made in the caller's thread at the first ``next()``, so random
    draws happen where and when DataLoader makes them; then the thread starts. An error raised
    for a batch reaches the caller with its type and traceback, and the next ``next()`` goes on
    with the batch after it. An iterator has ``len()``; ``close()`` on it, or leaving a ``with``
    block, stops its thread (waiting for it, bounded); a dropped iterator, an early ``break`` or
    an exception in the loop asks the thread to stop and never waits for it (the DataLoader
    iterator, with its workers, is released at once unless the thread is inside it). The Design
    page ("Iterators and their lifecycle") describes the whole lifecycle.

    Where prefetching cannot be exact: a dataset that draws from the global RNG (torch's, numpy's
    or Python's) in ``__getitem__`` with ``num_workers=0`` draws in the thread, interleaved with
    the caller's own draws, so its draws differ from DataLoader's; so do a sampler's draws after
    its first (torch's own samplers draw only at the first). The way out: ``num_workers > 0``
    (workers have their own RNG), or ``max_prefetch=0`` (no thread). Warnings raised while the
    thread makes a batch are shown when the caller receives it, filtered as they were raised.

    `state_dict` and `load_state_dict` resume a broken epoch exactly, counting only the batches
    the caller received; Lightning saves and restores them in its checkpoints.

    Args:
        dataset: The dataset, as `DataLoader`'s.
        *args: Positional `DataLoader` arguments after ``dataset``.
        **kwargs: Keyword `DataLoader` arguments, and the prefetch arguments: ``max_prefetch``,
            ``device``, ``mean``, ``std``, ``dtype``, ``channels_last``, ``input_key``,
            ``device_prefetch`` and ``non_blocking``. ``help(DataLoaderX)`` shows what each
            does, as does the Configuration page.

    The prefetch arguments are keyword-only and stored as same-named attributes.

    Raises:
        TypeError: An argument has the wrong type, or is none of its arguments (the message
            names the closest one).
        ValueError: An argument has a bad value, or ``device`` does not exist here.

    Examples:
        >>> loader = DataLoaderX(range(10), batch_size=4, max_prefetch=2)
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    # The prefetch arguments, each stored under its own name (see __init__); their names,
    # defaults and docs are `PrefetchOptions`' fields.
    max_prefetch: int
    device: str | torch.device | int | None
    mean: Sequence[float] | None
    std: Sequence[float] | None
    dtype: torch.dtype | None
    channels_last: bool
    input_key: int | str
    device_prefetch: int
    non_blocking: bool

    def __init__(self, dataset: Dataset[T_co], *args: Any, **kwargs: Any) -> None:
        # Checked before DataLoader builds anything. Every prefetch argument is stored under its
        # own name because frameworks (Lightning) rebuild a loader from its __init__ signature
        # and attributes; the checked and resolved forms live in the options and the pipeline.
        given, kwargs = _options.split(type(self).__name__, kwargs, _DATALOADER_ARGUMENTS)
        self._options = PrefetchOptions(**given)
        for name, value in self._options.arguments().items():
            setattr(self, name, value)
        self._pipeline = Pipeline(self._options)
        self._latest: Epoch | None = None
        self._resume: Saved | None = None
        self._live: weakref.WeakSet[PrefetchIterator[Any]] = weakref.WeakSet()
        if self._pipeline.device.type == "cuda" and _refuses_pinning(dataset, args, kwargs):
            self._pipeline.pin_host = False
        super().__init__(dataset, *args, **kwargs)

    def __iter__(self) -> PrefetchIterator[Any]:
        # DataLoader's own __iter__ decides, as for DataLoader: a new iterator each time
        # (`_get_iterator`, below), or with persistent workers the one it keeps, reset
        # (`PrefetchIterator._reset`).
        return super().__iter__()  # type: ignore[return-value]  # our _get_iterator's

    def _get_iterator(self) -> PrefetchIterator[Any]:
        """A new iterator: DataLoader's own, made here on the calling thread, behind the stages.

        On the calling thread because DataLoader installs its worker-failure (SIGCHLD) handler
        only from the main thread, forking workers from a side thread is unsafe, and a shuffling
        sampler with workers draws here, in DataLoader's order.
        """
        if self.num_workers > 0:
            # Workers fork: let threads of abandoned iterators finish first (see settle).
            settle(_engine.JOIN_TIMEOUT)
        resume = self._resume
        recorder = self._new_recorder()
        recorder.feed = self._snapshots()
        epoch, building = self._begin_epoch(recorder, draws_base_seed=True)
        with _handing(self, recorder), building:
            source = self._dataloader_iterator(resume, recorder.feed)
        recorder.serve(source)
        feed = self._resume_in_process(source, resume, recorder)
        iterator: PrefetchIterator[Any] = PrefetchIterator(
            source,
            self._pipeline,
            epoch,
            keep_source=self._keeps_iterator(),
            recorder=recorder,
            feed=feed.over(source) if feed is not None else None,
            own_calls=loop_calls(self),
        )
        self._live.add(iterator)
        return iterator

    def _dataloader_iterator(self, resume: Saved | None, notes: DatasetSnapshots | None) -> Any:
        """DataLoader's own iterator; with workers, started with DataLoaderX's worker functions
        (each batch carries its worker's state; a resumed worker loads its saved one; persistent
        workers over an IterableDataset leave their states in ``notes.ends`` as each epoch's
        iteration ends)."""
        if self.num_workers == 0:
            return super()._get_iterator()
        # Through Any: untyped in torch 2.4's stubs and typed later, so an ignore would be an
        # unused one on the other (mypy --strict, which a user's typed code runs over us).
        check: Any = self.check_worker_number_rationality
        check()
        ends = None
        if self._keeps_iterator() and is_iterable(self):
            context = self.multiprocessing_context or multiprocessing
            ends = Ends(context, self.num_workers)
            assert notes is not None  # made for every iterator with workers
            notes.ends = ends
        init = WorkerInit(self.worker_init_fn, worker_plans(resume, self.num_workers), ends)
        return WorkersIter(self, TaggingCollate(self.collate_fn), init)

    def _resume_in_process(
        self, source: Any, resume: Saved | None, recorder: IndexRecorder
    ) -> DatasetSnapshots | None:
        """Without workers: give the iterator DataLoader made over the dataset its saved state,
        and say whether the epoch's notes are needed (a dataset or iterator with its own state,
        or a fast-forward); with workers they always are."""
        feed = recorder.feed
        if self.num_workers > 0 or feed is None:
            return feed
        fetcher = getattr(source, "_dataset_fetcher", None)
        iterator = getattr(fetcher, "dataset_iter", None)
        if resume is not None and resume.in_epoch and not resume.fast_forward:
            if resume.iterator_state is not None:
                iterator.load_state_dict(resume.iterator_state)  # type: ignore[union-attr]  # checked at load
            if resume.ended:
                fetcher.ended = True  # type: ignore[union-attr]  # an IterableDataset's fetcher
        needed = (
            has_own_state(self.dataset)
            or has_own_state(iterator)
            or (resume is not None and resume.fast_forward)
        )
        if not needed:
            recorder.feed = None
            assert self._latest is not None
            self._latest.snapshots = None
        return recorder.feed

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the epoch the loader started last (by ``iter()``), running or not.

        Each iterator has its own, as ``iter(loader).stats``.
        """
        return self._latest.stats if self._latest is not None else EpochStats()

    @property
    def _index_sampler(self) -> Any:
        """DataLoader's index sampler; the iterator being made gets its own `IndexRecorder`."""
        handed = getattr(_handover, "pair", None)
        if handed is not None and handed[0] is self:
            return handed[1]
        return super()._index_sampler

    def _new_recorder(self) -> IndexRecorder:
        if is_iterable(self):  # DataLoader's placeholder sampler: nothing to replay
            return IndexRecorder(super()._index_sampler, random_generators(self), replays=False)
        lead = self.num_workers * (self.prefetch_factor or 0)
        return IndexRecorder(super()._index_sampler, random_generators(self), lead)

    def _begin_epoch(
        self, recorder: IndexRecorder, draws_base_seed: bool
    ) -> tuple[Epoch, contextlib.AbstractContextManager[None]]:
        """A new epoch, fresh or resumed: what to report of it, and what to wrap DataLoader's
        making or resetting of its iterator in."""
        resume, self._resume = self._resume, None
        position = Position()
        recorder.begin(position, resume)
        feed = recorder.feed
        if feed is not None:
            in_epoch = resume is not None and resume.in_epoch
            skipped = resume.consumed if resume is not None and in_epoch else 0
            fast = in_epoch and resume is not None and resume.fast_forward
            feed.begin(offset=0 if fast else skipped, skip=skipped if fast else 0, resumed=resume)
        if resume is not None and resume.dataset_state is not None:
            # Before DataLoader calls iter(dataset), or its new workers copy the dataset.
            self.dataset.load_state_dict(resume.dataset_state)  # type: ignore[attr-defined]  # checked at load
        epoch = Epoch(position)
        epoch.snapshots = feed
        self._latest = epoch
        return epoch, _beginning(epoch, recorder.building(draws_base_seed))

    def _snapshots(self) -> DatasetSnapshots | None:
        """Where the epoch's datasets and workers are noted after each batch: with workers
        always (each batch comes with its worker's note), without them for a dataset that may
        have a state (`_resume_in_process` drops it if it has none)."""
        # The stages run at most this far ahead of the batch the loop has.
        keep = self._options.max_prefetch + self._options.device_prefetch + 64
        if self.num_workers > 0:
            return DatasetSnapshots(keep)
        if not is_iterable(self) and not has_own_state(self.dataset):
            return None
        return DatasetSnapshots(keep, self.dataset, in_process=True)

    def _keeps_iterator(self) -> bool:
        """Whether DataLoader keeps one iterator for all epochs (persistent workers)."""
        return bool(self.persistent_workers and self.num_workers > 0)

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is in the epoch, as plain data, to resume it exactly later.

        Counts the batches the loop has received (an error raised in a batch's place counts as
        that batch), not those the stages have made ahead, of the epoch the loader started last.
        Call it when you checkpoint the model. The state is plain data (ints, lists, bools,
        strings, ``None``, dicts, and whatever a dataset's own ``state_dict()`` returns): it
        survives ``torch.save`` with ``torch.load(weights_only=True)`` and, where the dataset's
        state does, a JSON round trip; two states compare with ``==``. See `load_state_dict`,
        and the Design page of the docs ("Resume semantics") for every field.

        Besides the count it holds the random generator states the sampler and DataLoader's
        workers' base seed were drawn from, and, as they were right after the last batch the
        loop received: the dataset's own state where it has one (``state_dict()`` and
        ``load_state_dict()``, torchdata's ``Stateful`` protocol, for map-style and iterable
        datasets), the state of the iterator an IterableDataset's ``__iter__`` returned where
        that has one, and with workers each worker's: its torch, Python and numpy global
        generators and its copy's and iterator's states. To know them whatever the stages and
        the workers ran ahead, they are noted with every batch where it is made; a
        ``state_dict()`` that raises there does not end the epoch, but makes this method raise
        `ValueError` if it needs that state.

        Raises:
            ValueError: A dataset's or iterator's ``state_dict()`` raised after the last batch
                the loop received, so the state there is not known.

        Examples:
            >>> loader = DataLoaderX(range(10), batch_size=2, max_prefetch=1)
            >>> it = iter(loader)
            >>> [next(it).tolist() for _ in range(2)]
            [[0, 1], [2, 3]]
            >>> state = loader.state_dict()
            >>> state["consumed"]
            2
            >>> it.close()
            >>> again = DataLoaderX(range(10), batch_size=2)
            >>> again.load_state_dict(state)
            >>> [batch.tolist() for batch in again]
            [[4, 5], [6, 7], [8, 9]]
        """
        described = describe(self, super()._index_sampler)
        if self._resume is not None:  # loaded and not used yet: the same state back
            return self._resume.to_state(described)
        epoch = self._latest
        if epoch is None or epoch.tally.ended:
            kept = self._has_kept_iterator()
            recorder = getattr(self._iterator, "_recorder", None) if kept else None
            iterated = epoch is not None and self.num_workers == 0
            return between_epochs(self, recorder, kept, iterated).to_state(described)
        position = epoch.position
        assert position is not None  # every epoch DataLoaderX begins has one
        received = position.skipped + epoch.tally.count
        return inside_epoch(self, position, received, epoch.snapshots).to_state(described)

    def _has_kept_iterator(self) -> bool:
        return self._keeps_iterator() and self._iterator is not None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict` at the next ``iter()``.

        The next epoch yields exactly the batches the saved run had not yet handed to its loop,
        in order, with the same random draws, then later epochs draw as the saved run's would.
        A map-style dataset's skipped batches are skipped at the sampler: their data is never
        loaded. The loader's own ``generator`` and a sampler's generator are restored, and the
        workers get the saved run's base seed; the global RNG is left alone, so without a
        ``generator`` later epochs match when you restore ``torch.get_rng_state()`` with the
        rest of your checkpoint (the resumed epoch matches either way). With workers, each new
        worker gets the saved worker's torch, Python and numpy generator states and dataset
        state, and the round robin starts at the worker whose batch comes next, so random
        augmentations drawn in the workers replay. Persistent workers running in this loader
        are shut down: the resumed epoch starts new ones, as the saved run's.

        An ``IterableDataset`` resumes from its own state (the dataset's, in this process or in
        each worker, and the state of the iterator its ``__iter__`` returns, loaded before its
        first item); one with neither is fast-forwarded: the resumed epoch makes and drops the
        batches the saved run's loop received, and logs a warning saying so (logger
        ``prefetchx``). A ``DistributedSampler``'s epoch is yours to set, as always.

        Where exactness is impossible, this warns once and says what to do:

        * a state inside an epoch of a loader with ``in_order=False`` and workers over a
          map-style dataset: its batches come as the workers finish them, so which of the
          epoch's batches the loop received is not known. The next epoch is that epoch again,
          from its first batch, in the same order (way out: checkpoint between epochs, or
          ``in_order=True``);
        * a state saved with another ``num_workers``: the order of the batches is exact, but the
          workers' generators and dataset copies cannot be mapped onto other workers, so random
          draws made in the workers differ (way out: resume with the saved ``num_workers``).

        A sampler you built without a generator for a loader with one draws from the global
        RNG, which is then not replayed: the resumed epoch checks its first batch's indices,
        raises ``ValueError`` and ends; give that sampler the loader's generator.

        Raises:
            TypeError: ``state`` is not a state of a `DataLoaderX`.
            ValueError: A field of ``state`` is missing or malformed (the message names it and
                its value), fields contradict each other, ``state`` is of another version, comes
                from a loader with another dataset length, batch size, ``drop_last``, sampler,
                shard or ``in_order``, holds a dataset state for a dataset that has none, is
                inside an epoch of an IterableDataset saved with another ``num_workers``, or (at
                the next ``iter()`` or first batch) its replay draws other indices.
        """
        described = describe(self, super()._index_sampler)
        saved = Saved.from_state(state, described, random_generators(self))
        if saved.dataset_state is not None and not has_own_state(self.dataset):
            raise ValueError(
                "`state['dataset_state']` holds the dataset's own state, but this dataset "
                f"({type(self.dataset).__name__}) has no state_dict()/load_state_dict()."
            )
        if saved.num_workers != self.num_workers:
            saved = self._other_workers(saved)
        inside = saved.in_epoch and saved.consumed
        if inside and described.get("in_order") is False and not is_iterable(self):
            # An IterableDataset resumes each worker from its own state: in order or not.
            warnings.warn(
                f"prefetchx: the state was taken {saved.consumed} batches into an epoch of "
                "a loader with in_order=False and workers, whose batches come as the "
                "workers finish them: which of the epoch's batches the loop received is "
                "not known. The next epoch is that epoch again, from its first batch. "
                "Checkpoint between epochs, or use in_order=True, to resume exactly.",
                stacklevel=2,
            )
            saved = dataclasses.replace(saved, consumed=0)
        kept: Any = self._iterator  # persistent workers: their states cannot be set now
        if kept is not None:
            self._iterator = None
            kept._abandon()
        self._resume = saved

    def _other_workers(self, saved: Saved) -> Saved:
        """A state saved with another ``num_workers``: without its workers' states, or refused
        where the batches themselves would differ."""
        if is_iterable(self) and saved.in_epoch and saved.consumed:
            raise ValueError(
                f"`state` was taken {saved.consumed} batches into an epoch of an IterableDataset "
                f"with num_workers={saved.num_workers}; this loader has num_workers="
                f"{self.num_workers}, whose epoch interleaves other shards, so no batch of it "
                f"follows the saved ones. Resume with num_workers={saved.num_workers}, or from "
                "a state taken between epochs."
            )
        if saved.workers is not None:
            warnings.warn(
                f"prefetchx: the state was taken with num_workers={saved.num_workers}; this "
                f"loader has num_workers={self.num_workers}. The batches come in the saved "
                "order, but the saved workers' random generators and dataset copies cannot be "
                "given to other workers, so random draws made in the workers (augmentations) "
                f"differ from the saved run's. Resume with num_workers={saved.num_workers} to "
                "replay them.",
                stacklevel=3,
            )
        return dataclasses.replace(
            saved, workers=None, seed_at=None, num_workers=self.num_workers, next_worker=0
        )

    def close(self) -> None:
        """Stop every iterator of this loader still running, and shut down persistent workers.

        Each iterator's thread is waited for, at most 5 s (as by ``close()`` on an iterator),
        and so are the threads of iterators dropped earlier that are still finishing a batch; a
        wait longer than 1 s warns, naming what the thread is inside.
        The loader stays usable: a later ``iter()`` starts afresh.
        """
        kept: Any = self._iterator  # DataLoader's persistent iterator: one of ours
        self._iterator = None
        for iterator in list(self._live):
            if iterator is kept:
                iterator._abandon()
            else:
                iterator.close()
        settle(_engine.JOIN_TIMEOUT)

    @property
    def mixup_enabled(self) -> bool:
        """Whether the collate function mixes batches (timm's ``FastCollateMixup``).

        timm's training script reads and sets this on a prefetching loader to turn mixup off
        for the last epochs; as on timm's ``PrefetchLoader``, it is the collate function's
        ``mixup_enabled``, and ``False`` (setting it does nothing) for a collate function
        without one. Set it between epochs, as timm does: batches made ahead, and those of
        running or persistent workers (each has its own copy of the collate function), were
        collated before the change.
        """
        return bool(getattr(self.collate_fn, "mixup_enabled", False))

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        if hasattr(self.collate_fn, "mixup_enabled"):
            self.collate_fn.mixup_enabled = value

    @property
    def multiprocessing_context(self) -> Any:
        """DataLoader's ``multiprocessing_context``.

        A framework that rebuilds this loader as a plain `DataLoader` reads it with DataLoader's
        other arguments, and nothing in a training loop does: prefetchx's integrations are told
        of each read, to say at once that the rebuilt loader has neither stage.
        """
        _hooks.read(self, "multiprocessing_context")
        return DataLoader.multiprocessing_context.fget(self)  # type: ignore[attr-defined]

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        DataLoader.multiprocessing_context.fset(self, value)  # type: ignore[attr-defined]

    if not TYPE_CHECKING:  # a type checker would take every name as an attribute of the loader

        def __getattr__(self, name: str) -> Any:
            # Only for names not found otherwise (DataLoader has no __getattr__): a framework
            # asking for a mark of its own, such as "prepared already". The integrations are
            # told; the loader has no such attribute, as a DataLoader would not.
            if not name.startswith("__"):
                _hooks.read(self, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> DataLoaderX[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # What DataLoader pickles and copies, less the weak set of running iterators.
        state = self.__dict__.copy()
        state["_live"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_live"] = weakref.WeakSet()


_DATALOADER_ARGUMENTS = frozenset(inspect.signature(DataLoader.__init__).parameters) - {"self"}
"""The names DataLoader's own ``__init__`` takes, in the installed torch."""

_handover = threading.local()
"""``(loader, recorder)`` while that loader's DataLoader makes an iterator on this thread."""


@contextlib.contextmanager
def _handing(loader: DataLoaderX[Any], recorder: IndexRecorder | None) -> Iterator[None]:
    """While DataLoader makes its iterator, ``loader._index_sampler`` is ``recorder``."""
    if recorder is None:
        yield
        return
    previous = getattr(_handover, "pair", None)
    _handover.pair = (loader, recorder)
    try:
        yield
    finally:
        _handover.pair = previous


@contextlib.contextmanager
def _beginning(epoch: Epoch, building: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """Around DataLoader making or resetting its iterator for ``epoch``, inside ``building``.

    If that raises, no epoch began: DataLoader's next ``iter()`` begins a new one (with workers,
    a sampler whose first draw raises makes ``iter()`` raise), so a state taken now is between
    epochs.
    """
    try:
        with building:
            yield
    except BaseException:
        epoch.tally.ended = True
        raise


def _refuses_pinning(dataset: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the caller passed ``pin_memory=False``; if so, say what it costs, once."""
    signature = inspect.signature(DataLoader.__init__)
    given = signature.bind_partial(None, dataset, *args, **kwargs).arguments
    if "pin_memory" not in given or given["pin_memory"]:
        return False
    warnings.warn(
        "prefetchx: pin_memory=False with a CUDA target: host batches are not pinned, so every "
        "copy to the device is synchronous. The copy cannot overlap the step, and the side "
        "stream first waits for the caller's queued work, so each batch waits for the GPU to "
        "finish the steps queued before it. Leave pin_memory unset: the thread stage pins.",
        stacklevel=3,
    )
    return True


# DataLoader's arguments differ between torch versions; forwarding *args/**kwargs keeps every one
# of them, and this signature shows their real names and defaults to inspect(), IDEs and
# frameworks that rebuild loaders.
DataLoaderX.__init__.__signature__ = _options.signature(DataLoader.__init__)  # type: ignore[attr-defined]
DataLoaderX.__doc__ = _options.document(DataLoaderX.__doc__)
