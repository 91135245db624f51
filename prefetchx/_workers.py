"""DataLoader's worker processes, as DataLoaderX starts them: what resume needs from inside them.

A worker's dataset copy, its iterator and its random generators live in its process, and the
state after the last batch the loop received must be told however far the workers and the
stages have run ahead. So each batch carries a `Note` of its worker's state, made right after
the batch by `TaggingCollate` (the user's ``collate_fn``, then the note) and stripped again in
the main process before any stage sees the batch (`prefetchx._snapshots`). A resumed epoch's
workers get their saved states back from `WorkerInit` (the user's ``worker_init_fn``, then the
states), and `WorkersIter` starts the epoch's round robin at the worker whose batch comes next.

The loader's ``collate_fn`` and ``worker_init_fn`` stay the user's: DataLoader's iterator is
made over a `_View` of the loader that shows these two in their place.

A note holds the worker's torch, Python and numpy global generator states only when they
changed since its previous note (sending 10 kB a batch would cost more than telling a change:
about 4 us a batch, each generator's raw state read and compared as bytes), and the dataset's
and its iterator's own ``state_dict()`` where they have one (torchdata's ``Stateful``
protocol). A ``state_dict()`` that raises never breaks the epoch: the note keeps the error,
which `DataLoaderX.state_dict` raises if it needs that state.
"""

from __future__ import annotations

import ctypes
import pickle
import random
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _DatasetKind, _MultiProcessingDataLoaderIter

from prefetchx._state import generator_state, numpy_random_state, python_random_state

RawRng = tuple[bytes | None, tuple[Any, ...] | None, tuple[Any, ...] | None]
"""A worker's torch, Python and numpy generator states as read; ``None`` where unchanged."""


def has_own_state(obj: Any) -> bool:
    """Whether ``obj`` keeps its own state (``state_dict``/``load_state_dict``, torchdata's
    ``Stateful`` protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass(slots=True)
class Note:
    """A worker's (or, with ``worker=None``, this process's) state right after it made a batch.

    ``rng`` holds its generator states as read (a resumed worker's saved ones, before it brings
    its own: plain, as `prefetchx._state` has them); ``dataset_state`` the dataset's own state
    where it has one and is not its own iterator; ``iterator_state`` the state of the iterator
    its ``__iter__`` returned, where that has one (an IterableDataset's); ``ended`` whether that
    iterator is exhausted; ``error`` the text of a ``state_dict()`` that raised; ``epoch``
    which epoch of its DataLoader iterator it was made in (numbered by the main process as it
    takes the note off).
    """

    worker: int | None
    rng: RawRng | dict[str, Any] | None = None
    dataset_state: Any = None
    iterator_state: Any = None
    ended: bool = False
    error: str | None = None
    epoch: int = 0


class Tagged:
    """A batch with the `Note` of the worker that made it, on its way to the main process."""

    __slots__ = ("batch", "note")

    def __init__(self, batch: Any, note: Note) -> None:
        self.batch = batch
        self.note = note

    def pin_memory(self) -> Tagged:
        """DataLoader's pin thread pins what has this method by calling it: pin the batch."""
        return Tagged(pin_memory(self.batch), self.note)  # type: ignore[no-untyped-call]  # torch's


def take_note(worker: int | None, dataset: Any, fetcher: Any, rng: RawRng | None) -> Note:
    """The state of ``dataset`` and of ``fetcher``'s iterator now (an IterableDataset's: the
    fetcher DataLoader made over it), never raising."""
    note = Note(worker, rng)
    iterator = getattr(fetcher, "dataset_iter", None)
    try:
        if iterator is not None:
            note.ended = bool(getattr(fetcher, "ended", False))
            if has_own_state(iterator):
                note.iterator_state = iterator.state_dict()
        if iterator is not dataset and has_own_state(dataset):
            note.dataset_state = dataset.state_dict()
    except Exception as exc:  # a state nobody may ask for must not end the epoch (#63 item 4)
        note.error = f"{type(exc).__name__}: {exc}"
    return note


class TaggingCollate:
    """The collate function DataLoaderX's workers run: the user's, then a `Note`."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Tagged:
        batch = self.collate_fn(data)
        info = get_worker_info()
        assert info is not None  # only DataLoaderX's workers run it
        return Tagged(batch, take_note(info.id, info.dataset, _current.fetcher, _read_rng()))


@dataclass(frozen=True)
class WorkerPlan:
    """What one resumed worker loads when it starts (see `WorkerInit`)."""

    rng: dict[str, Any] | None = None
    dataset_state: Any = None
    iterator_state: Any = None
    ended: bool = False
    drain: bool = False


class WorkerInit:
    """The ``worker_init_fn`` DataLoaderX's workers run: the user's, then the worker's saved
    state, loaded as torchdata's StatefulDataLoader loads it.

    Order: the user's function (it may shard the dataset or draw), then the generators' states
    (as the saved worker's were after its last batch: they include the user's draws), then the
    dataset's own state; then the iterator DataLoader makes over the dataset gets its state
    before its first item, or, for a worker whose iteration had ended (``drain``), a restored
    iterator is run to its end first, so that what the dataset does at its end (count an
    epoch) is done, as it was in the saved worker.
    """

    def __init__(
        self,
        init_fn: Callable[[int], None] | None,
        plans: dict[int, WorkerPlan] | None = None,
        ends: Ends | None = None,
    ) -> None:
        self.init_fn = init_fn
        self.plans = plans or {}
        self.ends = ends

    def __call__(self, worker_id: int) -> None:
        _start_worker(self.ends, worker_id)
        if self.init_fn is not None:
            self.init_fn(worker_id)
        plan = self.plans.get(worker_id)
        if plan is not None:
            info = get_worker_info()
            assert info is not None
            _load(plan, info.dataset)


def _load(plan: WorkerPlan, dataset: Any) -> None:
    if plan.rng is not None:
        set_rng(plan.rng)
    if plan.dataset_state is not None:
        dataset.load_state_dict(plan.dataset_state)
    if plan.drain:
        iterator = iter(dataset)
        if plan.iterator_state is not None:
            iterator.load_state_dict(plan.iterator_state)
        for _ in iterator:
            pass
        return
    if plan.iterator_state is not None or plan.ended:

        def restore(fetcher: Any) -> None:
            if plan.iterator_state is not None:
                fetcher.dataset_iter.load_state_dict(plan.iterator_state)
            if plan.ended:
                fetcher.ended = True

        _current.pending = restore


def set_rng(rng: dict[str, Any]) -> None:
    """Set this process's global generators to ``rng`` (`plain_rng`'s form)."""
    torch.set_rng_state(generator_state(rng["torch"]))
    random.setstate(python_random_state(rng["random"]))
    numpy = sys.modules.get("numpy")
    if rng["numpy"] is not None and numpy is not None:
        numpy.random.set_state(numpy_random_state(rng["numpy"]))


def global_rngs() -> tuple[Any, ...]:
    """This process's torch, Python and numpy global generator states, as read."""
    numpy = sys.modules.get("numpy")
    return (
        torch.get_rng_state(),
        random.getstate(),
        numpy.random.get_state() if numpy is not None else None,
    )


def set_global_rngs(states: tuple[Any, ...]) -> None:
    """Set this process's global generators to what `global_rngs` read."""
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    numpy = sys.modules.get("numpy")
    if states[2] is not None and numpy is not None:
        numpy.random.set_state(states[2])


class Ends:
    """Where persistent workers over an IterableDataset leave their generator states each time
    their iteration ends: shared buffers, two a worker, made before the workers start.

    A worker's random draws after its last batch of an epoch (the items a ``drop_last`` batch
    drops, draws after the dataset's last item) reach no batch's note, and its next note may
    come after a state is taken: the worker writes its states here when an iteration ends,
    before it tells the main process so. A state needs the end of the epoch before the one it
    is in, or of the one it follows: each pass writes the buffer of its parity, which the next
    pass but one overwrites, and no pass begins before the loop has begun its epoch.
    """

    SIZE = 1 << 15  # pickled, the three generators' states take about 12 kB

    def __init__(self, context: Any, num_workers: int) -> None:
        self.buffers = [
            (context.Array("B", self.SIZE), context.Array("B", self.SIZE))
            for _ in range(num_workers)
        ]

    def write(self, worker: int, passes: int, rng: RawRng) -> None:
        """Worker ``worker``'s iteration number ``passes`` (from 1) ended with these states."""
        data = pickle.dumps((passes, rng))
        buffer = self.buffers[worker][passes % 2]
        with buffer.get_lock():
            if len(data) + 4 <= self.SIZE:
                buffer[4 : 4 + len(data)] = data
                buffer[0:4] = list(len(data).to_bytes(4, "little"))
            else:  # too large to keep: say none, rather than a wrong one
                buffer[0:4] = [0, 0, 0, 0]

    def read(self, worker: int, passes: int) -> RawRng | None:
        """Worker ``worker``'s generator states when its iteration number ``passes`` ended, if
        known."""
        buffer = self.buffers[worker][passes % 2]
        with buffer.get_lock():
            size = int.from_bytes(bytes(buffer[0:4]), "little")
            data = bytes(buffer[4 : 4 + size]) if size else b""
        if not data:
            return None
        ended, rng = pickle.loads(data)
        return rng if ended == passes else None


class _Current:
    """This worker process's fetcher, and what to do to the next one DataLoader makes."""

    def __init__(self, ends: Ends | None = None, worker: int = 0) -> None:
        self.fetcher: Any = None
        self.pending: Callable[[Any], None] | None = None
        self.passes = 0  # fetchers made: iterations begun over the dataset
        self.ends = ends
        self.worker = worker
        self.sent: list[Any] = [None, None, None]  # the generator states the last note carried
        self.words: bytes | None = None  # numpy's raw generator state, read with them
        self.python_raw: tuple[bytes, Any] | None = None  # Python's, read with them


_current = _Current()


def _start_worker(ends: Ends | None = None, worker: int = 0) -> None:
    """Prepare this new worker process: forget what a fork copied, and see DataLoader's fetchers.

    DataLoader makes the fetcher, and with it the iterator over an IterableDataset, right after
    ``worker_init_fn``, and again at each epoch of persistent workers. Its notes need that
    iterator, and a resumed iterator its state before the first item: the worker's own copy of
    ``_DatasetKind.create_fetcher`` (this process only, never the main one) hands each new
    fetcher here.
    """
    global _current
    _current = _Current(ends, worker)
    create = _DatasetKind.create_fetcher
    if getattr(create, "prefetchx_hook", False):
        return

    def create_fetcher(*args: Any) -> Any:
        fetcher = create(*args)  # type: ignore[no-untyped-call]  # torch's
        _current.fetcher = fetcher
        _current.passes += 1
        pending, _current.pending = _current.pending, None
        if pending is not None:
            pending(fetcher)
        if _current.ends is not None and hasattr(fetcher, "dataset_iter"):
            fetcher.fetch = _noting_the_end(fetcher.fetch)
        return fetcher

    create_fetcher.prefetchx_hook = True  # type: ignore[attr-defined]  # a mark on a function
    _DatasetKind.create_fetcher = staticmethod(create_fetcher)  # type: ignore[method-assign]


def _noting_the_end(fetch: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fetch``, which writes this worker's generator states to its `Ends` buffer when the
    iteration ends (before DataLoader's worker loop tells the main process so)."""

    def fetching(index: Any) -> Any:
        try:
            return fetch(index)
        except StopIteration:
            ends = _current.ends
            assert ends is not None
            ends.write(_current.worker, _current.passes, _full_rng())
            raise

    return fetching


def _full_rng() -> RawRng:
    torch_state, python_state, numpy_state = global_rngs()
    return torch_state.numpy().tobytes(), python_state, numpy_state


def _read_rng() -> RawRng:
    """This worker's generator states, each ``None`` where it is as in the previous note."""
    sent = _current.sent
    torch_state = torch.get_rng_state().numpy().tobytes()  # 1 us; torch.equal takes 4
    out: list[Any] = [None, None, None]
    if torch_state != sent[0]:
        out[0] = torch_state
    python_state = _python_state(sent[1])
    if python_state is not sent[1]:
        out[1] = python_state
    numpy_state = _numpy_state(sent[2])
    if numpy_state is not sent[2]:
        out[2] = numpy_state
    _current.sent = [torch_state, python_state, numpy_state]
    return out[0], out[1], out[2]


def _python_state(before: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """Python's global generator state, or ``before`` itself if it has not changed.

    ``random.getstate()`` builds a tuple of 625 ints (8.5 us a batch on the 2-core VM), and
    comparing two costs 5.5 us more: most of the 24 us that telling the three generators'
    changes took, where two workers making batches of 20 us with no step ran at 0.90x plain (now
    0.94x). The generator's raw state (its position and 624 words, read from the object's memory
    at the offset `_python_layout` found) and the Gaussian it keeps cost under 1 us to read and
    compare, and any draw changes one of them.
    """
    raw = _python_raw()
    if before is not None and raw is not None and raw == _current.python_raw:
        return before
    _current.python_raw = raw
    state = random.getstate()
    return before if state == before else state


def _python_raw() -> tuple[bytes, Any] | None:
    """The raw state of the generator behind ``random.getstate`` and its kept Gaussian, or
    ``None`` where its layout is not known."""
    global _python_offset
    generator: random.Random = random.getstate.__self__  # type: ignore[attr-defined]  # a bound method
    if _python_offset is None:
        _python_offset = _python_layout(generator)
    if _python_offset < 0:
        return None
    kept = getattr(generator, "gauss_next", None)
    return ctypes.string_at(id(generator) + _python_offset, 625 * 4), kept


def _python_layout(generator: random.Random) -> int:
    """Where in ``generator``'s object its position and 624 words lie (as CPython's
    ``_random.Random`` keeps them: the position, an ``int``, then the words), found by looking
    for them; -1 if they are not there once, exactly."""
    *words, position = generator.getstate()[1]
    raw = struct.pack(f"=i{len(words)}I", position, *words)
    memory = ctypes.string_at(id(generator), type(generator).__basicsize__)
    offset = memory.find(raw)
    return offset if offset >= 0 and memory.find(raw, offset + 1) < 0 else -1


_python_offset: int | None = None
"""`_python_layout`'s answer, once found: the same for every generator of the same type."""


def _numpy_state(before: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """numpy's global generator state, or ``before`` itself if it has not changed.

    Reading it costs about 80 us; its Mersenne Twister's raw words cost under 1 us to compare,
    and they change with every draw but one: a Gaussian the generator kept from the draw before
    (``has_gauss``, ``before[3]``). So the state is read only after such a draw may have been
    made, or when the words changed.
    """
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    words = _numpy_words(numpy)
    if before is not None and words is not None and words == _current.words and not before[3]:
        return before
    _current.words = words
    state: tuple[Any, ...] = numpy.random.get_state()
    return state


def _numpy_words(numpy: Any) -> bytes | None:
    """The raw state of numpy's global Mersenne Twister (624 words and a position), or
    ``None`` where it cannot be read."""
    try:
        address = numpy.random.mtrand._rand._bit_generator.ctypes.state_address
    except AttributeError:
        return None
    return ctypes.string_at(address, 624 * 4 + 4)


class _View:
    """The loader as DataLoader's iterator reads it, with DataLoaderX's worker functions."""

    def __init__(self, loader: Any, collate_fn: Any, worker_init_fn: Any) -> None:
        self.__dict__["_prefetchx_loader"] = loader
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_prefetchx_loader"], name)


class WorkersIter(_MultiProcessingDataLoaderIter):
    """DataLoader's iterator over worker processes, started with DataLoaderX's worker functions.

    Its index sampler is an `IndexRecorder`, whose ``turn`` says, when set, how many workers on
    the epoch's round robin starts: DataLoader sends batch ``i`` of an epoch to worker
    ``i % num_workers``, and a resumed epoch that skipped ``k`` batches must send its first to
    the worker the uninterrupted epoch sent batch ``k`` to, which holds that worker's state.
    """

    def __init__(self, loader: Any, collate_fn: TaggingCollate, worker_init_fn: WorkerInit) -> None:
        # Through Any: untyped in torch 2.4's stubs and typed later (see DataLoaderX's
        # `_dataloader_iterator`).
        base: Any = super()
        base.__init__(_View(loader, collate_fn, worker_init_fn))

    def _next_index(self) -> Any:
        index = super()._next_index()  # type: ignore[no-untyped-call]  # torch's
        recorder = self._index_sampler
        if recorder.turn:
            turn, recorder.turn = recorder.turn, 0
            for _ in range(turn % self._num_workers):
                next(self._worker_queue_idx_cycle)
        return index
