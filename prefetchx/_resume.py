"""Exact mid-epoch resume: what the sampler drew from, and how far the loop got.

Each DataLoader iterator that DataLoaderX makes is given an `IndexRecorder` as its index sampler
(DataLoader's ``_index_sampler``: the batch sampler, or the sampler when batching is off). It hands
the sampler's index batches on untouched, iterating the sampler exactly when and as often as
DataLoader asks, and notes, for the epoch's `Position`, the states of the random generators the
sampler draws from twice: when DataLoader calls ``iter()`` on it (a sampler that shuffles in
``__iter__`` draws then) and at its first draw (a generator-based sampler such as
``RandomSampler`` draws then), plus a checksum of the first index batch. A state is then O(1)
plain data: those generator states, how many batches the loop has received (counted where batches
leave the last stage, so whatever the stages ran ahead does not count), and the checksum.

Resuming sets the generators to the noted states at the same two points, draws the consumed
batches' indices again without loading their data, checks the first one against the checksum,
and lets the DataLoader load the rest. The caller's global RNG comes out of a resumed ``iter()``
as it went in; a generator of the loader or of its sampler comes out where the uninterrupted
run's would be, so later epochs draw the same. DataLoader draws a base seed for its workers from
the loader's generator (or the global one) whenever it makes a new iterator, but not when
persistent workers reuse one; a state taken between epochs says which the saved run's next epoch
would do, and the resumed epoch draws or undoes that draw to match.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = "prefetchx.DataLoaderX"
VERSION = 2
_SAMPLER_FIELDS = (
    "loader",
    "epoch_in_progress",
    "consumed",
    "digest",
    "rng_states",
    "rng_states_at_iter",
    "base_seed_next",
)
_ITERABLE_FIELDS = ("loader", "epoch_in_progress", "consumed", "dataset_state")

States = list[torch.Tensor | None]
"""One state per generator of `random_generators`; ``None`` leaves that generator alone."""


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


def draw_base_seed(generator: torch.Generator) -> None:
    """Draw from ``generator`` what DataLoader draws for its workers' base seed."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)


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
    for name in ("num_replicas", "rank"):  # DistributedSampler: a rank's shard
        value = getattr(sampler, name, None)
        if isinstance(value, int):
            described[name] = value
    if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
        # Batches come as the workers finish them (torch >= 2.6), not in the sampler's order.
        described["in_order"] = False
    return described


def _length(sized: Any) -> int | None:
    try:
        return len(sized)
    except TypeError:
        return None


@dataclass
class Position:
    """Where one epoch is in its sampler: filled in as the sampler starts drawing.

    ``skipped`` batches were consumed before a resume; ``at_iter`` and ``at_draw`` are the
    generators' states when DataLoader called ``iter()`` on the sampler and at its first draw;
    ``digest`` is the first index batch's checksum (``None`` for an empty epoch).
    """

    skipped: int = 0
    at_iter: States | None = None
    at_draw: States | None = None
    digest: int | None = None

    @property
    def drawn(self) -> bool:
        """Whether the sampler has started this epoch's draws."""
        return self.at_draw is not None


@dataclass(frozen=True)
class Resume:
    """A loaded state, waiting for the next epoch."""

    in_epoch: bool
    consumed: int
    digest: int | None
    at_iter: States
    at_draw: States
    base_seed_next: bool = True
    """Between epochs: whether the saved run's next epoch draws DataLoader's base seed first."""

    def to_state(self, loader: dict[str, Any]) -> dict[str, Any]:
        """The state as plain data, for the loader that `describe` described."""
        return {
            **_header(loader, self.in_epoch, self.consumed),
            "digest": self.digest,
            "rng_states": _copies(self.at_draw),
            "rng_states_at_iter": _copies(self.at_iter),
            "base_seed_next": self.base_seed_next,
        }

    @classmethod
    def from_state(
        cls, state: object, loader: dict[str, Any], generators: Sequence[torch.Generator]
    ) -> Resume:
        """Check every field of ``state`` against this loader and its generators; parse it.

        Raises:
            TypeError: ``state`` is not a DataLoaderX state.
            ValueError: A field is missing or malformed (the error names it and its value), or
                the state comes from another loader.
        """
        fields = _checked_header(state, _SAMPLER_FIELDS, loader)
        at_draw = _states(fields, "rng_states", generators)
        at_iter = _states(fields, "rng_states_at_iter", generators)
        return cls(
            in_epoch=_bool(fields, "epoch_in_progress"),
            consumed=_count(fields, "consumed"),
            digest=_digest(fields),
            at_iter=at_iter,
            at_draw=at_draw,
            base_seed_next=_bool(fields, "base_seed_next"),
        )


@dataclass(frozen=True)
class IterableResume:
    """A loaded state of a loader over an ``IterableDataset``.

    ``dataset_state`` is the dataset's own ``state_dict()`` (torchdata's convention), taken
    where the loop was: between epochs, or after the last batch the loop received. ``None``
    when the dataset has none, or when its state there is not known (its copies iterate in the
    worker processes): such a state inside an epoch cannot resume it.
    """

    in_epoch: bool
    consumed: int
    dataset_state: Any = None

    def to_state(self, loader: dict[str, Any]) -> dict[str, Any]:
        """The state as plain data."""
        return {
            **_header(loader, self.in_epoch, self.consumed),
            "dataset_state": self.dataset_state,
        }

    @classmethod
    def from_state(cls, state: object, loader: dict[str, Any]) -> IterableResume:
        """Check every field of ``state`` against this loader; parse it."""
        fields = _checked_header(state, _ITERABLE_FIELDS, loader)
        return cls(
            _bool(fields, "epoch_in_progress"), _count(fields, "consumed"), fields["dataset_state"]
        )


def has_own_state(dataset: Any) -> bool:
    """Whether ``dataset`` keeps its own iteration state (``state_dict``/``load_state_dict``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


class DatasetSnapshots(Iterator[Any]):
    """The source of the stages for an ``IterableDataset`` with its own state, iterated in this
    process (``num_workers=0``): it notes ``dataset.state_dict()`` right after each batch is made
    (or fails), in whichever thread made it, so the state of the batch the loop received last
    can be told however far the thread has run ahead.

    Only the last ``keep`` states are kept: the stages run at most that far ahead of the loop.
    """

    def __init__(self, dataset: Any, keep: int) -> None:
        self._dataset = dataset
        self._source: Iterator[Any] = iter(())
        self._states: collections.deque[tuple[int, Any]] = collections.deque(maxlen=keep)
        self._made = 0
        self.initial = dataset.state_dict()
        """The state before the epoch's first batch: made before DataLoader's iter(dataset)."""

    def over(self, source: Iterator[Any]) -> DatasetSnapshots:
        """Take batches from ``source``, DataLoader's iterator made after this."""
        self._source = source
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._source)
        except StopIteration:
            raise
        except BaseException:
            self._note()
            raise
        self._note()
        return batch

    def _note(self) -> None:
        self._made += 1
        self._states.append((self._made, self._dataset.state_dict()))

    def after(self, count: int) -> Any:
        """The dataset's state after the first ``count`` outcomes, or ``None`` if not kept."""
        if count == 0:
            return self.initial
        for made, state in reversed(self._states):
            if made == count:
                return state
        return None


def _header(loader: dict[str, Any], in_epoch: bool, consumed: int) -> dict[str, Any]:
    """The fields every state has."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "loader": loader,
        "epoch_in_progress": in_epoch,
        "consumed": consumed,
    }


def _copies(states: States) -> States:
    return [s.clone() if s is not None else None for s in states]


def _checked_header(
    state: object, required: Sequence[str], loader: dict[str, Any]
) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise TypeError(f"`state` must be a dict from DataLoaderX.state_dict(), got {got!r}.")
    if state.get("version") != VERSION:
        raise ValueError(
            f"`state` has version {state.get('version')!r}; this prefetchx reads version {VERSION}."
        )
    missing = [name for name in required if name not in state]
    if missing:
        raise ValueError(f"`state` lacks {', '.join(missing)}: is it a whole state_dict()?")
    theirs = state["loader"]
    if not isinstance(theirs, dict):
        raise ValueError(f"`state['loader']` must be a dict, got {theirs!r}.")
    differ = sorted(k for k in loader.keys() | theirs.keys() if loader.get(k) != theirs.get(k))
    if differ:
        detail = "; ".join(f"{k} {theirs.get(k)!r} there, {loader.get(k)!r} here" for k in differ)
        raise ValueError(f"`state` comes from a different loader: {detail}.")
    return state


def _bool(state: dict[str, Any], name: str) -> bool:
    value = state[name]
    if not isinstance(value, bool):
        raise ValueError(f"`state['{name}']` must be a bool, got {value!r}.")
    return value


def _count(state: dict[str, Any], name: str) -> int:
    value = state[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`state` has {name}={value!r}; it must be an int >= 0.")
    return value


def _digest(state: dict[str, Any]) -> int | None:
    value = state["digest"]
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32
    ):
        raise ValueError(
            f"`state['digest']` must be None or a 32-bit checksum (an int from 0 to 2**32 - 1), "
            f"got {value!r}."
        )
    return value


def _states(state: dict[str, Any], name: str, generators: Sequence[torch.Generator]) -> States:
    values = state[name]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"`state['{name}']` must be a list of generator states, got {values!r}.")
    if len(values) != len(generators):
        raise ValueError(
            f"`state['{name}']` holds {len(values)} random generator states; this loader's "
            f"sampler draws from {len(generators)}."
        )
    out: States = []
    for i, (value, generator) in enumerate(zip(values, generators, strict=True)):
        if value is not None:
            _check_generator_state(f"state['{name}'][{i}]", value, generator)
        out.append(value)
    return out


def _check_generator_state(where: str, value: object, generator: torch.Generator) -> None:
    """Refuse now what ``generator.set_state`` would refuse at the next ``iter()``."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        got = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else repr(value)
        )
        raise ValueError(f"`{where}` must be a uint8 generator state from get_state(), got {got}.")
    probe = torch.Generator(device=generator.device)
    try:
        probe.set_state(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"`{where}` is not a state of a {generator.device} random generator: {exc}"
        ) from None


class IndexRecorder:
    """Stands in for one DataLoader iterator's index sampler; each epoch is `begin`-ed first.

    DataLoader calls ``iter()`` on its index sampler when it makes an iterator (twice with
    workers) and at each reset of persistent workers; each call iterates the real sampler once,
    when DataLoader asks, and the iterator it returns notes the epoch's `Position` at its
    first draw.
    """

    def __init__(self, sampler: Any, generators: Sequence[torch.Generator], lead: int = 0) -> None:
        self.sampler = sampler
        self.generators = generators
        self.lead = lead
        """Draws DataLoader makes ahead of the loop: its workers' index queues, primed with
        ``prefetch_factor * num_workers`` draws; 0 without workers."""
        self._global = generators[0] is torch.default_generator
        self._position = Position()
        self._resume: Resume | None = None
        self._passes = 0  # draws after a replay whose failures the saved run's loop received
        self._building = False
        self._caller_global: torch.Tensor | None = None
        self._served: weakref.ref[Any] | None = None

    def serve(self, iterator: Any) -> None:
        """The DataLoader iterator made over this recorder: once an epoch's position is noted,
        its ``_sampler_iter`` is set to the sampler's own iterator, so later draws pass through
        nothing of ours (see `_draws`)."""
        self._served = weakref.ref(iterator)  # the iterator holds this recorder

    def __len__(self) -> int:
        return len(self.sampler)

    def begin(self, position: Position, resume: Resume | None, draws_base_seed: bool) -> None:
        """The next epoch: note it in ``position``, and replay ``resume`` if there is one.

        ``draws_base_seed`` says whether DataLoader draws its base seed for this epoch (a new
        iterator) or not (persistent workers reset).
        """
        self._position = position
        self._resume = resume
        self._passes = 0
        if resume is None:
            return
        if resume.in_epoch:
            position.skipped = resume.consumed
        elif resume.base_seed_next and not draws_base_seed:
            # The saved run's next epoch draws DataLoader's base seed before its sampler; a reset
            # draws none here, so draw it, from the generator it would come from.
            set_states(self.generators[1:], resume.at_draw[1:])
            if resume.at_draw[0] is not None:
                self.generators[0].set_state(resume.at_draw[0])
            draw_base_seed(self.generators[0])
            self._resume = None  # from here on, a fresh epoch
        elif resume.base_seed_next:
            # A new iterator draws the base seed first, as the saved run's next epoch would.
            set_states(self.generators, resume.at_draw)
            self._resume = None

    @contextlib.contextmanager
    def building(self, draws_base_seed: bool) -> Iterator[None]:
        """Around DataLoader making (or resetting) its iterator for the epoch `begin` set up.

        A resumed epoch must leave the caller's global RNG as it found it, while DataLoader draws
        its base seed from it here: that draw is undone, at the sampler's first draw if it comes
        while the iterator is made (workers prime their index queue), else at the end.
        """
        resume = self._resume
        undo = (
            draws_base_seed
            and self._global
            and resume is not None
            and (resume.in_epoch or not resume.base_seed_next)
        )
        self._caller_global = torch.default_generator.get_state() if undo else None
        self._building = True
        try:
            yield
        finally:
            self._building = False
            caller, self._caller_global = self._caller_global, None
            if caller is not None and not self._position.drawn:
                torch.default_generator.set_state(caller)

    def __iter__(self) -> Iterator[Any]:
        resume = self._resume if self._resume is not None and self._resume.in_epoch else None
        if resume is not None:
            caller = self._caller_state() if resume.at_iter[0] is not None else None
            set_states(self.generators, resume.at_iter)
            source = iter(self.sampler)  # a sampler that shuffles in __iter__ draws here
            self._restore(caller)
            at_iter = resume.at_iter
        else:
            at_iter = self._states()
            source = iter(self.sampler)
            self._position.at_iter = at_iter  # a state taken before the first draw needs it
        return self._draws(source, at_iter)

    def _draws(self, source: Iterator[Any], at_iter: States) -> Iterator[Any]:
        """The epoch's index batches: the first ``next()`` notes the position (or replays the
        consumed draws); each later one is the sampler's own ``next()``.

        Not a generator: an exception from the sampler would end it, and the epoch with it,
        where DataLoader asks the sampler again at the next batch and goes on. After the first
        draw, `map` over `itertools.repeat` calls the sampler's ``next()`` from C (no Python
        frame a batch), and never ``iter()`` again: a sampler whose ``__iter__`` restarts
        itself and returns itself (Lightning's predict wrapper) would start over. From the
        third draw on, the DataLoader iterator draws from the sampler directly (`_hand_back`).
        """
        first = _Once(lambda: self._first(source, at_iter))

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

    def _first(self, source: Iterator[Any], at_iter: States) -> Any:
        """The epoch's first index batch, its position noted, or a resumed epoch's first batch
        to load after replaying those consumed; `StopIteration` for an epoch with none."""
        position, resume = self._position, self._resume
        if resume is not None and resume.in_epoch:
            first = self._replay(source, resume)
            position.at_iter, position.at_draw = resume.at_iter, resume.at_draw
            position.digest = resume.digest
            if first is None:
                raise StopIteration
            return first
        if resume is not None:  # between epochs, and this epoch draws no base seed
            set_states(self.generators[1:], resume.at_draw[1:])
            caller = self._caller_global if self._building else None
            if caller is not None:  # undo the base seed DataLoader drew while building
                torch.default_generator.set_state(caller)
            elif resume.at_draw[0] is not None:
                self.generators[0].set_state(resume.at_draw[0])
        at_draw = self._states()
        try:
            first = next(source)
        finally:  # drawn, or tried: an error here is an outcome, and the epoch goes on
            position.at_iter, position.at_draw = at_iter, at_draw
        position.digest = digest(first)
        return first

    def _replay(self, source: Iterator[Any], resume: Resume) -> Any:
        """Draw the consumed batches again and check them; the first batch to load, if any.

        A generator whose saved state is ``None`` (the caller's global RNG, in a state taken
        before the epoch's first draw) is drawn from as it is, and keeps that draw.
        """
        caller = self._caller_state() if resume.at_draw[0] is not None else None
        try:
            set_states(self.generators, resume.at_draw)
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
                if slots == skipped:
                    self._passes = max(0, received - drawn - 1)
                    return indices
                slots += 1
            raise AssertionError("unreachable: the loop returns or raises")
        finally:
            self._restore(caller)

    def _states(self) -> States:
        return [g.get_state() for g in self.generators]

    def _caller_state(self) -> torch.Tensor | None:
        """The caller's global RNG state to put back after a replay, if the sampler uses it."""
        if not self._global:
            return None
        if self._building and self._caller_global is not None:
            return self._caller_global  # as it was before DataLoader drew its base seed
        return torch.default_generator.get_state()

    def _restore(self, caller: torch.Tensor | None) -> None:
        if caller is not None:
            torch.default_generator.set_state(caller)


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


def between_epochs(generators: Sequence[torch.Generator], base_seed_next: bool) -> Resume:
    """A state for the next epoch: it draws from the generators as they are now.

    The global RNG is the caller's to save and restore with the rest of training.
    """
    states: States = [None if g is torch.default_generator else g.get_state() for g in generators]
    return Resume(False, 0, None, states, list(states), base_seed_next)


def before_first_draw(position: Position, generators: Sequence[torch.Generator]) -> Resume:
    """A state for an epoch whose iterator is made but whose sampler has not drawn yet.

    Its first draw will come from the generators as they are now (the global RNG: as the caller
    restores it).
    """
    now = between_epochs(generators, False).at_draw
    at_iter = position.at_iter if position.at_iter is not None else list(now)
    return Resume(True, 0, None, at_iter, now, False)
