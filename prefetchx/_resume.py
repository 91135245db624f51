"""Exact mid-epoch resume: what the sampler drew, and how far the loop got.

The loader's index sampler (DataLoader's ``_index_sampler``: the batch sampler, or the sampler
when batching is off) is wrapped in an `IndexRecorder`. Each epoch it notes the state of the
random generators just before the sampler starts drawing, and a checksum of the first index
batch. A state is then O(1) plain data: those generator states, how many batches the loop has
received (counted where batches leave the last stage, so whatever the stages ran ahead does not
count), and the checksum.

Resuming sets the generators to the noted states, draws the consumed batches' indices again
without loading their data, checks the first one against the checksum, and lets the DataLoader
load the rest. The caller's global RNG comes out of a resume untouched; a generator of the loader
or of its sampler comes out where the uninterrupted run's would be, so later epochs draw the same.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = "prefetchx.DataLoaderX"
VERSION = 1
_FIELDS = {"loader", "epoch_in_progress", "consumed", "digest", "rng_states"}


def digest(indices: Any) -> int:
    """A checksum of one index batch that is the same in every process (no ``hash()``: a str
    key's hash changes with PYTHONHASHSEED)."""
    return zlib.crc32(repr(indices).encode())


def random_generators(loader: Any) -> list[torch.Generator]:
    """The generators the loader's sampler draws from, in a fixed order, each once.

    The loader's ``generator`` (which DataLoader also gives a shuffling sampler), else the
    global one; then any other generator the sampler or the batch sampler's sampler holds.
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
    for name in ("num_replicas", "rank"):  # DistributedSampler: a rank's shard
        value = getattr(sampler, name, None)
        if isinstance(value, int):
            described[name] = value
    return described


def _length(sized: Any) -> int | None:
    try:
        return len(sized)
    except TypeError:
        return None


@dataclass(frozen=True)
class Resume:
    """A loaded state, waiting for the next epoch."""

    in_epoch: bool
    consumed: int
    digest: int | None
    rng_states: list[torch.Tensor | None]

    def to_state(self, loader: dict[str, Any]) -> dict[str, Any]:
        """The state as plain data, for the loader that `describe` described."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "loader": loader,
            "epoch_in_progress": self.in_epoch,
            "consumed": self.consumed,
            "digest": self.digest,
            "rng_states": [s.clone() if s is not None else None for s in self.rng_states],
        }

    @classmethod
    def from_state(cls, state: object, loader: dict[str, Any], generators: int) -> Resume:
        """Check ``state`` against this loader's description and generators; parse it."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise TypeError(f"`state` must be a dict from DataLoaderX.state_dict(), got {got!r}.")
        if state.get("version") != VERSION:
            raise ValueError(
                f"`state` has version {state.get('version')!r}; this prefetchx reads version "
                f"{VERSION}."
            )
        missing = sorted(_FIELDS - state.keys())
        if missing:
            raise ValueError(f"`state` lacks {', '.join(missing)}: is it a whole state_dict()?")
        theirs = state["loader"]
        differ = sorted(k for k in loader.keys() | theirs.keys() if loader.get(k) != theirs.get(k))
        if differ:
            detail = "; ".join(
                f"{k} {theirs.get(k)!r} there, {loader.get(k)!r} here" for k in differ
            )
            raise ValueError(f"`state` comes from a different loader: {detail}.")
        states = list(state["rng_states"])
        if len(states) != generators:
            raise ValueError(
                f"`state` holds {len(states)} random generator states; this loader's sampler "
                f"draws from {generators}."
            )
        check = state["digest"]
        consumed = state["consumed"]
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"`state` has consumed={consumed!r}; it must be an int >= 0.")
        return cls(
            bool(state["epoch_in_progress"]),
            consumed,
            int(check) if check is not None else None,
            states,
        )


class EpochIndices:
    """One epoch of index batches from the sampler, recorded so that the epoch can be replayed.

    The sampler's first draw happens in `start`, which the loader calls on its own thread (so a
    shuffling sampler draws from the global RNG in the same order as under DataLoader), or which
    the DataLoader's workers' index prefetch triggers while the iterator is being made. What is
    recorded is taken then: the generators' states and a checksum of the first index batch; after
    it, `batches` hands the sampler's batches on with no work per batch (a loop with no step work
    pays for every instruction here).
    """

    def __init__(
        self, sampler: Iterable[Any], generators: Sequence[torch.Generator], resume: Resume | None
    ) -> None:
        self._sampler = sampler
        self._generators = generators
        self._resume = resume if resume is not None and resume.in_epoch else None
        self._source: Iterator[Any] | None = None
        self._lookahead: list[Any] = []
        self.skipped = self._resume.consumed if self._resume is not None else 0
        self.rng_states: list[torch.Tensor] = []
        self.first_digest: int | None = None

    def start(self) -> None:
        """Note the generators' states, start the sampler, replay skipped batches, draw one."""
        if self._source is not None:
            return
        if self._resume is not None:
            set_states(self._generators, self._resume.rng_states)
        self.rng_states = [g.get_state() for g in self._generators]
        self._source = source = iter(self._sampler)
        for drawn in range(max(self.skipped, 1)):
            try:
                indices = next(source)
            except StopIteration:
                if self.skipped:
                    raise ValueError(
                        f"prefetchx: the state says the loop received {self.skipped} batches "
                        f"of this epoch, but the sampler now yields only {drawn}."
                    ) from None
                return  # an empty epoch
            if drawn == 0:
                self.first_digest = digest(indices)
            if not self.skipped:  # the first draw of a lazy sampler happens now, on this thread
                self._lookahead.append(indices)
        check = self._resume.digest if self._resume is not None else None
        if self.skipped and check is not None and self.first_digest != check:
            raise ValueError(
                f"prefetchx: replaying the state's {self.skipped} consumed batches drew other "
                "indices than the run that saved it. The sampler's draws are not reproducible "
                "from torch generators (Python's random or numpy?), or the dataset, sampler or "
                "seed differ; resuming would train on the wrong samples."
            )

    def batches(self) -> Iterator[Any]:
        """The epoch's index batches after the skipped ones; starts the epoch if need be."""
        self.start()
        assert self._source is not None  # started above
        yield from self._lookahead
        self._lookahead.clear()
        yield from self._source


class IndexRecorder:
    """Stands in for the loader's index sampler; each ``iter()`` is one recorded epoch.

    DataLoader iterates its index sampler once per epoch, also when persistent workers reuse
    one iterator, so this object lives as long as the loader.
    """

    def __init__(self, sampler: Any, generators: Sequence[torch.Generator]) -> None:
        self.sampler = sampler
        self.generators = generators
        self._next: EpochIndices | None = None
        self.current: EpochIndices | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # DataLoader may ask more than once while it makes one iterator (its multiprocessing
        # iterator resets itself in __init__); every ask inside `epoch` gets that epoch.
        epoch = self._next or EpochIndices(self.sampler, self.generators, None)
        return epoch.batches()

    @contextlib.contextmanager
    def epoch(self, resume: Resume | None) -> Iterator[None]:
        """Around DataLoader's ``__iter__``: set up this epoch's indices, fresh or resumed.

        The sampler's first draw comes after DataLoader's own (its workers' base seed), as under
        DataLoader, and on this thread. A resumed epoch's first draw sets the generators to the
        saved states first, replays the consumed batches and checks them; the caller's global
        RNG is then put back as it was.
        """
        replaying = resume is not None and resume.in_epoch
        self.current = epoch = EpochIndices(self.sampler, self.generators, resume)
        self._next = epoch
        caller_rng = torch.default_generator.get_state() if replaying else None
        if resume is not None and not resume.in_epoch:  # the next epoch draws as the saved run's
            set_states(self.generators, resume.rng_states)
        try:
            yield
            epoch.start()  # unless the workers' index prefetch has started it already
        finally:
            self._next = None
            if caller_rng is not None:
                torch.default_generator.set_state(caller_rng)
