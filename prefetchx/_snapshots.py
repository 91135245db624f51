"""`DatasetSnapshots`: the states a resume needs, noted batch by batch where the batches are made.

The stages run ahead of the loop (pitfall 10 of the field: a state read at the source is
``max_prefetch`` + device-depth batches ahead of training), so the state after the last batch the
loop received is noted when that batch was made, and looked up by the loop's count later.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prefetchx._state import Saved
from prefetchx._workers import (
    Ends,
    Note,
    RawRng,
    Tagged,
    global_rngs,
    set_global_rngs,
    take_note,
)

logger = logging.getLogger("prefetchx")

Notes = dict[int | None, Note]
"""The latest note of each worker (``None``: this process) as of one outcome."""


class DatasetSnapshots:
    """The notes of one DataLoader iterator's batches, outcome by outcome, and where its
    epochs begin.

    With workers, each batch arrives `Tagged` with its worker's `Note` (see
    `prefetchx._workers`); without them, this process's ``dataset`` is noted right after each
    outcome, in whichever thread made it, and once before the epoch's first. `over` gives what
    the stages pull from in place of DataLoader's iterator, which takes the notes off. Outcomes
    are counted over the iterator's life (persistent workers reuse it), and the last ``keep``
    notes are kept: the stages run at most that far ahead of the loop.

    Nothing here holds DataLoader's iterator (the loader keeps this after the loop drops its
    iterator: the workers must shut down then, as DataLoader's do).
    """

    def __init__(self, keep: int, dataset: Any = None, in_process: bool = False) -> None:
        self._keep = keep
        self._dataset = dataset
        self._in_process = in_process
        self._source: weakref.ref[Any] | None = None
        self._window: collections.deque[tuple[int, Note | None]] = collections.deque()
        self._settled: Notes = {}  # each worker's latest note among those out of the window
        self._lock = threading.Lock()  # the stages' thread notes while a state reads
        self._rng: dict[int | None, RawRng] = {}  # each worker's latest generator states
        self._made = 0
        self._start = 0  # outcomes made before this epoch
        self._at_start: Notes = {}
        self._initial: Note | None = None  # this process's note before the epoch's first outcome
        self._offset = 0  # outcomes of this epoch the loop received before a resume
        self._next_worker = 0  # whose batch came first in this run's part of the epoch
        self.skip = 0
        """Outcomes to fast-forward over at the epoch's first ``next()``."""
        self.epochs = 0
        """Epochs begun over this iterator: 1 for all but persistent workers."""
        self.ends: Ends | None = None
        """Where persistent workers over an IterableDataset leave their states as an
        iteration ends."""

    def over(self, source: Iterator[Any]) -> Iterator[Any]:
        """What the stages pull from in place of ``source``, DataLoader's iterator."""
        self._source = weakref.ref(source)
        return _Feed(self, self._source)

    def __getstate__(self) -> dict[str, Any]:
        # Copied or pickled with its loader, as DataLoader's state is: without the iterator
        # and its workers' buffers.
        state = self.__dict__.copy()
        state["_source"] = None
        state["ends"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def end_rng(self, worker: int, epoch: int) -> RawRng | None:
        """The generator states of persistent worker ``worker`` when its iteration of epoch
        ``epoch`` (from 1) ended, if known: they were its states at the next epoch's start."""
        if self.ends is None or epoch < 1:
            return None
        return self.ends.read(worker, epoch)

    def begin(self, offset: int, skip: int = 0, resumed: Saved | None = None) -> None:
        """A new epoch, of which the loop received ``offset`` outcomes before a resume; and
        ``skip`` more to fast-forward over at its first ``next()``. A ``resumed`` epoch's saved
        workers count as noted before it: until a worker brings a note of its own, a state
        taken in this epoch holds the saved one."""
        self.epochs += 1
        self._start = self._made
        self._next_worker = 0
        if resumed is not None and resumed.workers is not None:
            self._settle(resumed)
        self._at_start = self.as_of_made(self._made) or {}
        self._initial = None
        if self._in_process and resumed is not None and resumed.in_epoch and not skip:
            # Until its first batch, the epoch is where the state put it: as saved (a dataset
            # whose state __iter__ sets up has not run it yet).
            self._initial = Note(
                None,
                dataset_state=resumed.dataset_state,
                iterator_state=resumed.iterator_state,
                ended=resumed.ended,
            )
        self._offset = offset
        self.skip = skip

    def _settle(self, resumed: Saved) -> None:
        assert resumed.workers is not None
        self._next_worker = resumed.next_worker if not resumed.fast_forward else 0
        for worker, saved in enumerate(resumed.workers):
            if saved is None:
                continue
            # As worker_states made them: a state drained (or, between epochs, any) is that of
            # an earlier epoch's iteration, one that ended unless it is drained.
            earlier = saved.drain or not resumed.in_epoch or resumed.fast_forward
            self._settled[worker] = Note(
                worker,
                rng=saved.rng,  # already plain: `plain_rng` takes it as it is
                dataset_state=saved.dataset_state,
                iterator_state=saved.iterator_state,
                ended=not saved.drain if earlier else saved.ended,
                epoch=self.epochs - 1 if earlier else self.epochs,
            )

    @property
    def in_process(self) -> bool:
        """Whether the batches are made in this process (no workers)."""
        return self._in_process

    def take(self) -> Note | None:
        """This process's note now (``None`` with workers: their batches bring theirs)."""
        if not self._in_process:
            return None
        source = self._source() if self._source is not None else None
        return take_note(None, self._dataset, getattr(source, "_dataset_fetcher", None), None)

    def starting(self) -> None:
        """Before the epoch's first outcome is made: note this process's state then."""
        if self._in_process and self._initial is None and self._made == self._start:
            self._initial = self.take()

    @property
    def made(self) -> int:
        """Outcomes made over this iterator's life."""
        return self._made

    def note(self, note: Note | None) -> None:
        """The next outcome was made, with ``note`` (``None``: none, an error from a worker)."""
        self._made += 1
        if note is not None:
            note.epoch = self.epochs
            if isinstance(note.rng, tuple):  # as a worker sends it: what changed
                note.rng = self._full_rng(note.worker, note.rng)
        with self._lock:
            self._window.append((self._made, note))
            while len(self._window) > self._keep:
                _, old = self._window.popleft()
                if old is not None:
                    self._settled[old.worker] = old

    def _read(self) -> tuple[Notes, list[tuple[int, Note | None]]]:
        with self._lock:
            return dict(self._settled), list(self._window)

    def _full_rng(self, worker: int | None, rng: RawRng) -> RawRng:
        """A note's generator states, those unchanged since the worker's previous note filled in
        from it (the worker sends only what changed)."""
        before = self._rng.get(worker, (None, None, None))
        full = (
            rng[0] if rng[0] is not None else before[0],
            rng[1] if rng[1] is not None else before[1],
            rng[2] if rng[2] is not None else before[2],
        )
        self._rng[worker] = full
        return full

    def as_of_made(self, made: int) -> Notes | None:
        """Each worker's latest note as of the ``made``-th outcome of the iterator; ``None`` if
        that is no longer known (out of the window)."""
        notes, window = self._read()
        if window and window[0][0] > made + 1:
            return None
        for index, note in window:
            if index > made:
                break
            if note is not None:
                notes[note.worker] = note
        return notes

    def as_of(self, received: int) -> Notes | None:
        """Each worker's latest note after the loop received ``received`` outcomes of this epoch
        (those before a resume included); ``None`` if that is no longer known."""
        if received == self._offset and self._in_process:
            self.starting()  # nothing made yet: the state is the epoch's start
            return {None: self._initial} if self._initial is not None else None
        return self.as_of_made(self._start + received - self._offset)

    @property
    def at_start(self) -> Notes:
        """Each worker's latest note before this epoch's first outcome (persistent workers)."""
        return self._at_start

    def next_worker(self, received: int, num_workers: int) -> int:
        """The worker whose batch comes after ``received`` outcomes of this epoch: the one after
        the worker of the last of them with a note, one further for each without (an error from
        a worker); with none of this epoch's, the one its start gave (a resumed epoch's)."""
        made = self._start + received - self._offset
        _, window = self._read()
        after = 0
        for index, note in reversed(window):
            if index > made:
                continue
            if index <= self._start:
                break
            if note is not None and note.worker is not None:
                return (note.worker + 1 + after) % num_workers
            after += 1
        return (self._next_worker + made - self._start) % num_workers


class _Feed(Iterator[Any]):
    """DataLoader's iterator as the stages see it: its batches, the notes taken off (or taken
    here, without workers), after a fast-forward where the epoch begins with one.

    It holds DataLoader's iterator weakly: the `PrefetchIterator` owns it, and releases it (its
    workers shut down) when it is closed or dropped, whatever still holds this feed.
    """

    def __init__(self, notes: DatasetSnapshots, source: weakref.ref[Iterator[Any]]) -> None:
        self._notes = notes
        self._source = source

    def __next__(self) -> Any:
        notes = self._notes
        if notes.skip:
            self._fast_forward()
        notes.starting()
        source = self._source()
        if source is None:  # released: its iterator was closed
            raise StopIteration
        try:
            item = next(source)
        except StopIteration:
            raise
        except BaseException:
            notes.note(notes.take())
            raise
        if isinstance(item, Tagged):
            notes.note(item.note)
            return item.batch
        notes.note(notes.take())
        return item

    def _fast_forward(self) -> None:
        notes = self._notes
        skip, notes.skip = notes.skip, 0
        logger.warning(
            "prefetchx: fast-forwarding %d batches: neither the dataset nor the iterator its "
            "__iter__ returns has state_dict()/load_state_dict(), so the resumed epoch makes "
            "and drops the batches the saved run's loop received. Give the dataset (or its "
            "iterator) its own state to skip them without loading them.",
            skip,
        )
        # Without workers the batches are made here, drawing from the global generators, which
        # the caller restored from the checkpoint as they were after the saved run had made
        # them: the rest of the epoch must draw from there again.
        kept = global_rngs() if notes.in_process else None
        try:
            for done in range(skip):
                try:
                    next(self)
                except StopIteration:
                    raise ValueError(
                        f"prefetchx: the state says the loop received {skip} batches of this "
                        f"epoch, but the dataset now yields only {done}: is it the same dataset?"
                    ) from None
                except Exception:  # an outcome the saved run's loop received in a batch's place
                    continue
        finally:
            if kept is not None:
                set_global_rngs(kept)
