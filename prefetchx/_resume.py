"""Exact mid-epoch resume: what the sampler and the generators drew from, and how far the loop got.

Each DataLoader iterator that DataLoaderX makes is given an `IndexRecorder` as its index sampler
(DataLoader's ``_index_sampler``: the batch sampler, or the sampler when batching is off). It hands
the sampler's index batches on untouched, iterating the sampler exactly when and as often as
DataLoader asks, and notes, for the epoch's `Position`, the states of the random generators the
sampler and DataLoader draw from: when DataLoader begins to make (or reset) its iterator, before
it draws its workers' base seed, and at the sampler's first draw (a generator-based sampler such
as ``RandomSampler`` draws then), plus a checksum of the first index batch. What the datasets and
the workers were at is noted batch by batch where the batches are made (`prefetchx._snapshots`,
`prefetchx._workers`). A state is then plain data (`prefetchx._state`): those generator states,
how many batches the loop has received (counted where batches leave the last stage, so whatever
the stages ran ahead does not count), the checksum, and the notes of the last batch received.

Resuming makes a new DataLoader iterator, with the generators set to the noted states at the same
points: DataLoader draws the same base seed (its workers get the same seeds) and the sampler the
same order; the consumed batches' indices are drawn again without loading their data and the
first is checked against the checksum; the workers get their generators', datasets' and
iterators' states back, and the round robin starts at the worker whose batch comes next. The
caller's global RNG comes out of a resumed ``iter()`` as it went in; a generator of the loader or
of its sampler comes out where the uninterrupted run's would be, so later epochs draw the same.
DataLoader draws a base seed whenever it makes a new iterator, but not when persistent workers
reuse one: a state then keeps the generator state the workers' seed was drawn from, and a state
taken between epochs says which the saved run's next epoch would do.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefetchx._snapshots import DatasetSnapshots
from prefetchx._state import Saved, States, WorkerState
from prefetchx._workers import Note, RawRng, WorkerPlan, has_own_state

__all__ = ["DatasetSnapshots", "has_own_state"]  # also re-exported: where the stages import them

logger = logging.getLogger("prefetchx")


def digest(indices: Any) -> int:
    """A checksum of one index batch that is the same in every process (no ``hash()``: a str
    key's hash changes with PYTHONHASHSEED)."""
    return zlib.crc32(repr(indices).encode())


def random_generators(loader: Any) -> list[torch.Generator]:
    """The generators the loader's sampler draws from, in a fixed order, each once.

    First the loader's ``generator``, else the global one: DataLoader draws its workers' base
    seed from it, and gives it to a shuffling sampler. Then any other generator the sampler or
    the batch sampler's sampler holds.
    """
    found: list[torch.Generator] = [loader.generator or torch.default_generator]
    batch_sampler = loader.batch_sampler
    for owner in (loader.sampler, getattr(batch_sampler, "sampler", None), batch_sampler):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def set_states(
    generators: Sequence[torch.Generator], states: Sequence[torch.Tensor | None]
) -> None:
    """Set each generator to its state; ``None`` leaves it alone (the caller's global RNG)."""
    for generator, state in zip(generators, states, strict=True):
        if state is not None:
            generator.set_state(state)


def describe(loader: Any, index_sampler: Any) -> dict[str, Any]:
    """What a state must agree on to be applied to this loader."""
    sampler = loader.sampler
    described: dict[str, Any] = {
        "dataset_len": _length(loader.dataset),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "batches_per_epoch": _length(index_sampler),
        "sampler": f"{type(sampler).__module__}.{type(sampler).__qualname__}",
    }
    if is_iterable(loader):
        described["iterable"] = True
    for name in ("num_replicas", "rank"):  # DistributedSampler: a rank's shard
        value = getattr(sampler, name, None)
        if isinstance(value, int):
            described[name] = value
    if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
        # Batches come as the workers finish them (torch >= 2.6), not in the sampler's order.
        described["in_order"] = False
    return described


def is_iterable(loader: Any) -> bool:
    """Whether the loader iterates an IterableDataset (DataLoader's own test)."""
    from torch.utils.data.dataloader import _DatasetKind

    return bool(loader._dataset_kind == _DatasetKind.Iterable)


def _length(sized: Any) -> int | None:
    try:
        return len(sized)
    except TypeError:
        return None


@dataclass
class Position:
    """Where one epoch is in its sampler: filled in as DataLoader makes its iterator and the
    sampler starts drawing.

    ``skipped`` batches were consumed before a resume; ``at_iter`` holds the generators' states
    when DataLoader began to make (or reset) its iterator, ``at_draw`` at the sampler's first
    draw; ``seed_at`` the state of the first generator that DataLoader drew the workers' base
    seed from, where that is not ``at_iter`` (persistent workers, after their first epoch);
    ``digest`` is the first index batch's checksum (``None`` for an empty epoch).
    """

    skipped: int = 0
    at_iter: States | None = None
    at_draw: States | None = None
    seed_at: torch.Tensor | None = None
    digest: int | None = None

    @property
    def drawn(self) -> bool:
        """Whether the sampler has started this epoch's draws."""
        return self.at_draw is not None


class IndexRecorder:
    """Stands in for one DataLoader iterator's index sampler; each epoch is `begin`-ed first,
    and DataLoader makes (or resets) its iterator inside `building`.

    DataLoader calls ``iter()`` on its index sampler when it makes an iterator (twice with
    workers: before and after it draws its base seed) and at each reset of persistent workers;
    each call iterates the real sampler once, when DataLoader asks, and the iterator it returns
    notes the epoch's `Position` at its first draw. ``replays`` is ``False`` over an
    IterableDataset, whose placeholder sampler a resume does not need to draw again.
    """

    def __init__(
        self,
        sampler: Any,
        generators: Sequence[torch.Generator],
        lead: int = 0,
        replays: bool = True,
    ) -> None:
        self.sampler = sampler
        self.generators = generators
        self.lead = lead
        """Draws DataLoader makes ahead of the loop: its workers' index queues, primed with
        ``prefetch_factor * num_workers`` draws; 0 without workers."""
        self.replays = replays
        self.turn = 0
        """Workers on from the first that the epoch's round robin starts at (`WorkersIter`)."""
        self.feed: DatasetSnapshots | None = None
        """The iterator's notes of its datasets and workers, if it keeps any."""
        self.seed_at: torch.Tensor | None = None
        """The first generator's state DataLoader drew this iterator's base seed from."""
        self._global = generators[0] is torch.default_generator
        self._position = Position()
        self._resume: Saved | None = None
        self._passes = 0  # draws after a replay whose failures the saved run's loop received
        self._building = False
        self._iters = 0
        self._caller: torch.Tensor | None = None  # the caller's global RNG, to put back
        self._switch: States | None = None  # to set once DataLoader has drawn its base seed
        self._served: weakref.ref[Any] | None = None

    def serve(self, iterator: Any) -> None:
        """The DataLoader iterator made over this recorder: once an epoch's position is noted,
        its ``_sampler_iter`` is set to the sampler's own iterator, so later draws pass through
        nothing of ours (see `_draws`)."""
        self._served = weakref.ref(iterator)  # the iterator holds this recorder

    def __len__(self) -> int:
        return len(self.sampler)

    def begin(self, position: Position, resume: Saved | None) -> None:
        """The next epoch: note it in ``position``, and replay ``resume`` if there is one."""
        self._position = position
        self._resume = resume
        self._passes = 0
        self.turn = 0
        if resume is not None and resume.in_epoch:
            position.skipped = resume.consumed
            position.at_iter, position.at_draw = resume.at_iter, resume.at_draw
            position.seed_at, position.digest = resume.seed_at, resume.digest
            if not self.replays and not resume.fast_forward:
                self.turn = resume.next_worker

    @contextlib.contextmanager
    def building(self, draws_base_seed: bool) -> Iterator[None]:
        """Around DataLoader making (``draws_base_seed``) or resetting its iterator for the epoch
        `begin` set up: the generators start from the saved states, and the epoch's are noted.

        A resumed epoch's workers must draw the saved run's base seed: from the epoch's own
        starting states, or where persistent workers drew theirs epochs before, from the state
        the state kept for it, and then the epoch's. A resumed epoch must leave the caller's
        global RNG as it found it: what is set on it is put back at the sampler's first draw if
        that comes while the iterator is made (workers prime their index queues), else at the end.
        """
        position, resume = self._position, self._resume
        caller = torch.default_generator.get_state() if self._global else None
        seed, start = _starts(resume, len(self.generators))
        if seed is None:
            set_states(self.generators, start)
        else:
            self.generators[0].set_state(seed)
            self._switch = [caller if s is None and i == 0 else s for i, s in enumerate(start)]
        if draws_base_seed:
            self.seed_at = seed if seed is not None else self.generators[0].get_state()
        if resume is None or not resume.in_epoch:
            position.at_iter = self._switch if self._switch is not None else self._states()
            position.seed_at = None if draws_base_seed and seed is None else self.seed_at
        in_epoch = resume is not None and resume.in_epoch
        self._caller = caller if in_epoch and self._global else None
        self._building, self._iters = True, 0
        try:
            yield
        finally:
            self._building = False
            self._apply_switch()
            self._put_back_callers()  # after a first draw, already put back

    def _apply_switch(self) -> None:
        switch, self._switch = self._switch, None
        if switch is not None:
            set_states(self.generators, switch)

    def __iter__(self) -> Iterator[Any]:
        self._iters += 1
        if self._iters > 1:  # workers make a second sampler iterator after the base seed
            self._apply_switch()
        return self._draws(iter(self.sampler))  # a sampler that shuffles in __iter__ draws here

    def _draws(self, source: Iterator[Any]) -> Iterator[Any]:
        """The epoch's index batches: the first ``next()`` notes the position (or replays the
        consumed draws); each later one is the sampler's own ``next()``.

        Not a generator: an exception from the sampler would end it, and the epoch with it,
        where DataLoader asks the sampler again at the next batch and goes on. After the first
        draw, `map` over `itertools.repeat` calls the sampler's ``next()`` from C (no Python
        frame a batch), and never ``iter()`` again: a sampler whose ``__iter__`` restarts
        itself and returns itself (Lightning's predict wrapper) would start over. From the
        third draw on, the DataLoader iterator draws from the sampler directly (`_hand_back`).
        """
        first = _Once(lambda: self._first(source))

        def parts() -> Iterator[Iterator[Any]]:
            yield first
            if not first.ended:  # an empty epoch ends there, as DataLoader's would; a refused
                # replay too: the batches after it would be other than the saved run's
                if self._passes:
                    yield _passing(source, self._passes)
                self._hand_back(source)
                yield map(next, itertools.repeat(source))

        return itertools.chain.from_iterable(parts())

    def _hand_back(self, source: Iterator[Any]) -> None:
        """Nothing is left to note of the epoch: the DataLoader iterator, drawing now, draws
        from the sampler's ``source`` itself from here on, as DataLoader's own does, so that a
        draw costs the loop no call of ours (0.3 us a batch on the 2-core VM,
        ``benchmarks/no_work.py``'s ``source`` arm). Not while DataLoader is still making that
        iterator (workers priming their index queues): `serve` has not named it yet."""
        served = self._served() if self._served is not None else None
        if served is not None and getattr(served, "_index_sampler", None) is self:
            served._sampler_iter = source

    def _first(self, source: Iterator[Any]) -> Any:
        """The epoch's first index batch, its position noted, or a resumed epoch's first batch
        to load after replaying those consumed; `StopIteration` for an epoch with none."""
        self._apply_switch()
        position, resume = self._position, self._resume
        if resume is not None and resume.in_epoch:
            if not self.replays:
                self._put_back_callers()
                return next(source)
            first = self._replay(source, resume)
            if first is None:
                raise StopIteration
            return first
        at_draw = self._states()
        try:
            first = next(source)
        finally:  # drawn, or tried: an error here is an outcome, and the epoch goes on
            position.at_draw = at_draw
        position.digest = digest(first)
        return first

    def _replay(self, source: Iterator[Any], resume: Saved) -> Any:
        """Draw the consumed batches again and check them; the first batch to load, if any.

        A generator whose saved state is ``None`` (the caller's global RNG, in a state taken
        before the epoch's first draw) is drawn from as it is, and keeps that draw. Sets
        `turn` to the draws skipped: DataLoader gave each to the next worker in turn.
        """
        caller = self._callers() if resume.at_draw[0] is not None else None
        try:
            set_states(self.generators, resume.at_draw)
            if any(state is None for state in resume.at_draw):
                # Drawn from as it is: what it was at this draw is this epoch's now, so that a
                # state taken later in the epoch replays this draw, not the RNG as it is then.
                self._position.at_draw = self._states()
            skipped = resume.consumed
            # A draw that raised reached the saved run's loop in place of a batch: without
            # workers the batch of that draw; with workers, whose index queues DataLoader keeps
            # `lead` draws ahead, the batch received when it drew (whose data is lost), so draw
            # `lead + i` fails batch `i`. Failures before that bound were received.
            received = self.lead + skipped
            slots = 0  # batches of the saved run's loop drawn so far
            for drawn in itertools.count():
                try:
                    indices = next(source)
                except StopIteration:
                    if slots < skipped:
                        raise NotReplayed(
                            f"prefetchx: the state says the loop received {skipped} batches of "
                            f"this epoch, but the sampler now yields only {slots}."
                        ) from None
                    return None
                except Exception:
                    if drawn == 0 and resume.digest is not None:
                        raise _not_replayed() from None
                    if drawn >= received:
                        raise  # the saved run's loop gets it next
                    if not self.lead:
                        slots += 1
                    continue  # the sampler goes on after it, as DataLoader asks again
                if drawn == 0 and resume.digest is not None and digest(indices) != resume.digest:
                    raise _not_replayed()
                if drawn == 0 and resume.digest is None:
                    self._position.digest = digest(indices)  # this epoch's first draw, noted
                if slots == skipped:
                    self._passes = max(0, received - drawn - 1)
                    return indices
                slots += 1
                self.turn += 1
            raise AssertionError("unreachable: the loop returns or raises")
        finally:
            if caller is not None:
                torch.default_generator.set_state(caller)
            self._caller = None

    def _states(self) -> States:
        return [g.get_state() for g in self.generators]

    def _callers(self) -> torch.Tensor | None:
        """The caller's global RNG state to put back after a replay, if the sampler uses it."""
        if not self._global:
            return None
        if self._building and self._caller is not None:
            return self._caller  # as it was before DataLoader drew its base seed
        return torch.default_generator.get_state()

    def _put_back_callers(self) -> None:
        if self._caller is not None:
            torch.default_generator.set_state(self._caller)
            self._caller = None


def _starts(resume: Saved | None, count: int) -> tuple[torch.Tensor | None, States]:
    """For an epoch: the state of the first generator that DataLoader draws its base seed from
    (``None``: the states the epoch starts from), and the states the epoch starts from
    (``None`` entries: as they are)."""
    if resume is None:
        return None, [None] * count
    start = resume.at_iter if resume.in_epoch else resume.at_draw
    if resume.in_epoch or not resume.base_seed_next:
        return resume.seed_at, start
    return None, start


def between_epochs(
    loader: Any, recorder: IndexRecorder | None, kept: bool, iterated: bool
) -> Saved:
    """A state for the next epoch: it draws from the generators as they are now.

    ``kept``: persistent workers go on into the next epoch (over ``recorder``), which then
    draws no base seed; their states are saved. ``iterated``: the loader's dataset was
    iterated in this process, so its own ``state_dict()`` must work. The global RNG is the
    caller's to save and restore with the rest of training.
    """
    generators = random_generators(loader)
    states: States = [None if g is torch.default_generator else g.get_state() for g in generators]
    workers = None
    if kept and recorder is not None and recorder.feed is not None:
        notes = recorder.feed.as_of_made(recorder.feed.made) or {}
        # Every worker's iteration ended with the epoch, after its last note.
        workers = worker_states(notes, loader, recorder.feed, is_iterable(loader), between=True)
    return Saved(
        in_epoch=False,
        consumed=0,
        at_iter=states,
        at_draw=list(states),
        seed_at=recorder.seed_at if kept and recorder is not None else None,
        base_seed_next=not kept,
        dataset_state=dataset_state(loader.dataset, iterated),
        num_workers=loader.num_workers,
        workers=workers,
    )


def inside_epoch(loader: Any, position: Position, received: int, feed: Any) -> Saved:
    """A state ``received`` outcomes into the epoch at ``position`` (those the loop received
    before a resume included)."""
    generators = random_generators(loader)
    iterable = is_iterable(loader)
    if position.drawn:
        assert position.at_iter is not None
        assert position.at_draw is not None
        at_iter, at_draw, check = position.at_iter, position.at_draw, position.digest
    else:  # the sampler has not drawn yet: its first draw comes from the generators as they are
        at_draw = [None if g is torch.default_generator else g.get_state() for g in generators]
        at_iter = position.at_iter if position.at_iter is not None else list(at_draw)
        check = None
    saved = Saved(
        in_epoch=True,
        consumed=received,
        at_iter=at_iter,
        at_draw=at_draw,
        seed_at=position.seed_at,
        digest=check,
        base_seed_next=False,
        num_workers=loader.num_workers,
    )
    if feed is None:  # no dataset or worker states to note: a map-style dataset without workers
        return _fast_forward(saved) if iterable else saved
    notes = feed.as_of(received)
    if notes is None:
        raise RuntimeError(
            f"prefetchx: the state after batch {received} of this epoch is no longer known: the "
            "stages ran further ahead of the loop than the notes kept."
        )
    if loader.num_workers == 0:
        note = notes.get(None)
        if note is None:
            return _fast_forward(saved) if iterable else saved
        _raise_failed(note, received)
        if iterable and note.dataset_state is None and note.iterator_state is None:
            return _fast_forward(saved)
        return _replace(
            saved,
            dataset_state=note.dataset_state,
            iterator_state=note.iterator_state,
            ended=note.ended,
        )
    main = dataset_state(loader.dataset, iterated=False)
    workers = worker_states(notes, loader, feed, iterable, received)
    stateless = main is None and all(
        w is None or (w.dataset_state is None and w.iterator_state is None) for w in workers
    )
    if iterable and stateless:  # from the epoch's start: the workers as they began it
        start = worker_states(feed.at_start, loader, feed, iterable)
        return _replace(_fast_forward(saved), workers=start)
    if not iterable and getattr(loader, "in_order", True) is False:
        # Resumed as the epoch again from its start (see load_state_dict): the workers as
        # they began it.
        workers = worker_states(feed.at_start, loader, feed, iterable)
        return _replace(saved, dataset_state=main, workers=workers)
    next_worker = feed.next_worker(received, loader.num_workers) if iterable else 0
    return _replace(saved, dataset_state=main, workers=workers, next_worker=next_worker)


def worker_states(
    notes: dict[int | None, Note],
    loader: Any,
    feed: DatasetSnapshots,
    iterable: bool,
    received: int | None = None,
    between: bool = False,
) -> tuple[WorkerState | None, ...]:
    """Each worker's state from its latest note, for a resumed epoch ``feed.epochs`` (the next
    one, ``between`` epochs).

    A note from an earlier epoch was taken before that epoch's iteration ended: the resumed
    worker drains its restored iterator (an IterableDataset's own state, or its iterator's)
    before it begins, or, without such a state, starts from the generator states it had when
    that iteration ended. A worker with no note starts as DataLoader starts it.
    """
    out: list[WorkerState | None] = []
    for worker in range(loader.num_workers):
        note = notes.get(worker)
        if note is None:
            out.append(None)
            continue
        _raise_failed(note, received)
        current = note.epoch == feed.epochs and not between
        drain = (
            iterable
            and not current
            and not note.ended
            and (note.dataset_state is not None or note.iterator_state is not None)
        )
        rng = note.rng
        if iterable and not current and not drain:
            # The worker's states as its last epoch's iteration ended (after the items a
            # drop_last batch dropped): as the resumed epoch begins.
            ended = feed.end_rng(worker, feed.epochs if between else feed.epochs - 1)
            rng = ended if ended is not None else rng
        out.append(
            WorkerState(
                rng=plain_rng(rng),
                dataset_state=note.dataset_state,
                # An earlier epoch's iterator is done with: the resumed epoch makes a new one.
                iterator_state=note.iterator_state if current or drain else None,
                ended=current and note.ended,
                drain=drain,
            )
        )
    return tuple(out)


def worker_plans(saved: Saved | None, num_workers: int) -> dict[int, WorkerPlan]:
    """What each new worker loads when it starts, for the resumed epoch ``saved``."""
    if saved is None or saved.workers is None or saved.num_workers != num_workers:
        return {}
    return {
        i: WorkerPlan(w.rng, w.dataset_state, w.iterator_state, w.ended, w.drain)
        for i, w in enumerate(saved.workers)
        if w is not None
    }


def plain_rng(rng: RawRng | dict[str, Any] | None) -> dict[str, Any] | None:
    """A worker's generator states, as a note holds them, as plain data (`prefetchx._state`);
    a saved state's, plain already, as it is."""
    from prefetchx._state import plain_numpy_state, plain_python_state

    if rng is None or isinstance(rng, dict):
        return rng
    torch_state, python_state, numpy_state = rng
    if torch_state is None or python_state is None:
        return None  # not yet filled in from an earlier note: none reached this process
    return {
        "torch": list(torch_state),
        "random": plain_python_state(python_state),
        "numpy": None if numpy_state is None else plain_numpy_state(numpy_state),
    }


def dataset_state(dataset: Any, iterated: bool) -> Any:
    """The dataset's own state now, ``None`` without one.

    A copy that was never iterated here (its workers iterate theirs) may have no state yet (one
    set up by its ``__iter__``): its ``state_dict()`` raising then means none.
    """
    if not has_own_state(dataset):
        return None
    try:
        return dataset.state_dict()
    except Exception:
        if iterated:
            raise
        logger.debug("prefetchx: the dataset's state_dict() raised; saved as None", exc_info=True)
        return None


def _raise_failed(note: Note, received: int | None) -> None:
    if note.error is not None:
        where = "this process" if note.worker is None else f"worker {note.worker}"
        after = f" after batch {received} of the epoch" if received is not None else ""
        raise ValueError(
            f"prefetchx: the dataset's (or its iterator's) state_dict() raised in {where}"
            f"{after}, so the state there is not known: {note.error}"
        )


def _fast_forward(saved: Saved) -> Saved:
    return _replace(saved, fast_forward=True)


def _replace(saved: Saved, **changes: Any) -> Saved:
    import dataclasses

    return dataclasses.replace(saved, **changes)


class NotReplayed(ValueError):
    """The consumed batches of a saved epoch cannot be drawn again: the resumed epoch ends."""


def _not_replayed() -> NotReplayed:
    return NotReplayed(
        "prefetchx: replaying the state's consumed batches drew other indices than the run "
        "that saved it. The sampler's draws are not reproducible from torch generators "
        "(Python's random or numpy?), or the dataset, sampler or seed differ; resuming would "
        "train on the wrong samples."
    )


def _passing(source: Iterator[Any], draws: int) -> Iterator[Any]:
    """The next ``draws`` draws of ``source``, those that raise left out: after a replay, the
    failures the saved run's loop received, drawn again as DataLoader's workers draw ahead."""
    for _ in range(draws):
        try:
            yield next(source)
        except StopIteration:
            return
        except Exception:  # received by the saved run's loop
            continue


class _Once:
    """An iterator of the one value ``make()`` returns, made at the first ``next()``.

    ``make`` is called once: if it raises, the exception goes to the caller and the iterator is
    exhausted, as it is after its value; ``ended`` says whether it raised `StopIteration` or
    `NotReplayed`, after which nothing follows.
    """

    __slots__ = ("_make", "ended")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make: Callable[[], Any] | None = make
        self.ended = False

    def __iter__(self) -> _Once:
        return self

    def __next__(self) -> Any:
        make, self._make = self._make, None
        if make is None:
            raise StopIteration
        try:
            return make()
        except (StopIteration, NotReplayed):
            self.ended = True
            raise
