"""Datasets and one runner for resume tests: an interrupted and resumed run against DataLoader's
uninterrupted one, random draws included."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from prefetchx import DataLoaderX

try:
    import numpy as np
except ImportError:  # the draws below leave numpy out
    np = None  # type: ignore[assignment]

Make = Callable[[type[DataLoader[Any]]], DataLoader[Any]]


def draws() -> list[int]:
    """What a random augmentation draws: from torch's, Python's and numpy's global RNGs."""
    # One Gaussian a draw from Python's too: it keeps every other one (``gauss_next``).
    out = [int(torch.randint(0, 10**6, ())), random.randrange(10**6)]
    out.append(round(random.gauss(0.0, 1.0) * 10**6))
    if np is not None:
        # One Gaussian a draw: numpy keeps every other one from the draw before (has_gauss).
        out += [int(np.random.randint(0, 10**6)), round(float(np.random.randn()) * 10**6)]
    return out


def worker() -> list[int]:
    """Which worker made an item, and the seed DataLoader gave it (-1 without workers)."""
    info = get_worker_info()
    return [-1, -1] if info is None else [info.id, info.seed % 10**6]


class Augmented(Dataset[list[int]]):
    """``n`` items, each its index, its worker and seed, and random draws made where it is made
    (``draw=False``: none; without workers they race the loop's own once a thread runs)."""

    def __init__(self, n: int, draw: bool = True) -> None:
        self.n = n
        self.draw = draw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[int]:
        return [i, *worker(), *(draws() if self.draw else [])]


class Counted(Augmented):
    """A map-style dataset with its own state (torchdata's Stateful): how many items its copy
    made, which each item shows."""

    def __init__(self, n: int, draw: bool = True) -> None:
        super().__init__(n, draw)
        self.made = 0

    def __getitem__(self, i: int) -> list[int]:
        self.made += 1
        return [*super().__getitem__(i), self.made]

    def state_dict(self) -> dict[str, int]:
        return {"made": self.made}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.made = state["made"]


class Shards(IterableDataset[list[int]]):
    """``range(n)`` sharded over the workers, each item with its worker and random draws.

    ``state``: ``"dataset"`` keeps where it is in the dataset itself, and the epoch its copy is
    in (counted at the end of each pass, by the copy that iterates), which each item shows; its
    state lives in what ``__iter__`` set up: ``state_dict()`` raises before the first
    ``__iter__`` (#63 item 4). ``"iterator"`` keeps where it is in the iterator ``__iter__``
    returns; ``None`` nowhere (a resume fast-forwards it). These two show epoch 0: a count kept
    outside any state is not resumable.
    """

    def __init__(self, n: int, state: str | None, draw: bool = True) -> None:
        self.n = n
        self.kind = state
        self.draw = draw
        self.epoch = 0
        self.start = 0
        if state == "dataset":
            self.state_dict = self._dataset_state
            self.load_state_dict = self._load_dataset_state

    def _range(self) -> range:
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return range(first, self.n, step)

    def __iter__(self) -> Iterator[list[int]]:
        if self.kind == "iterator":
            return _ShardIterator(self)
        return self._generate()

    def _generate(self) -> Iterator[list[int]]:
        items = list(self._range())
        self.position = self.start  # what __iter__ sets up
        self.start = 0
        while self.position < len(items):
            i = items[self.position]
            self.position += 1
            drawn = draws() if self.draw else []
            yield [i, *worker(), *drawn, self.epoch if self.kind == "dataset" else 0]
        self.position = 0
        self.epoch += 1

    def _dataset_state(self) -> dict[str, int]:
        return {"position": self.position, "epoch": self.epoch}  # AttributeError before iter

    def _load_dataset_state(self, state: dict[str, int]) -> None:
        self.start, self.epoch = state["position"], state["epoch"]


class _ShardIterator(Iterator[list[int]]):
    def __init__(self, dataset: Shards) -> None:
        self.dataset = dataset
        self.items = list(dataset._range())
        self.position = 0

    def __next__(self) -> list[int]:
        if self.position >= len(self.items):
            raise StopIteration
        i = self.items[self.position]
        self.position += 1
        return [i, *worker(), *(draws() if self.dataset.draw else []), 0]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def build(
    cls: type[DataLoader[Any]], dataset: Any, prefetch: dict[str, Any] | None = None, **kwargs: Any
) -> DataLoader[Any]:
    """``cls(dataset, **kwargs)``, with the ``prefetch`` arguments where ``cls`` takes them."""
    if issubclass(cls, DataLoaderX):
        kwargs.update(prefetch or {})
    return cls(dataset, **kwargs)


def plain(batch: Any) -> Any:
    """A batch as lists, to compare."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [plain(b) for b in batch]
    return batch


def epoch_of(it: Any) -> list[Any]:
    return [plain(b) for b in it]


def through_disk(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint brings it back: torch.save, a weights-only load, and JSON."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    assert loaded == state
    again: dict[str, Any] = json.loads(json.dumps(loaded))
    assert again == state
    return again


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def global_rngs() -> tuple[Any, ...]:
    """The global generators a checkpoint saves: torch's, Python's, numpy's."""
    return (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state() if np is not None else None,
    )


def set_global_rngs(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if np is not None:
        np.random.set_state(states[2])


def uninterrupted(make: Make, epochs: int) -> list[list[Any]]:
    """DataLoader's epochs, from a seeded start."""
    seed_all(0)
    loader = make(DataLoader)
    return [epoch_of(loader) for _ in range(epochs)]


def interrupted_and_resumed(
    make: Make, epoch: int, consumed: int, later: int = 2, end: str = "break"
) -> list[list[Any]]:
    """DataLoaderX's epochs before ``epoch``, then ``consumed`` batches of it, a checkpoint, the
    loop left by ``end`` (``"break"``, ``"exception"``, ``"drop"``), and a new loader resumed
    from the checkpoint in a process whose RNG starts elsewhere: the rest of the epoch and
    ``later`` more. ``consumed=None`` checkpoints after the epoch, between epochs."""
    seed_all(0)
    loader = make(DataLoaderX)
    before = [epoch_of(loader) for _ in range(epoch)]
    got: list[Any] = []
    state: dict[str, Any] = {}
    rngs = global_rngs()

    def checkpoint() -> None:
        nonlocal state, rngs
        state, rngs = through_disk(loader.state_dict()), global_rngs()

    it: Any = iter(loader)
    if consumed == 0:
        checkpoint()
    try:
        for batch in it if consumed != 0 else ():
            got.append(plain(batch))
            if len(got) == consumed:
                checkpoint()
                if end == "exception":
                    raise KeyError("the step failed")
                break
    except KeyError:
        pass
    if end == "drop" or end == "exception":
        del it
    else:
        it = None
    if consumed is None or len(got) < consumed:
        checkpoint()  # after the epoch
    assert isinstance(loader, DataLoaderX)
    loader.close()

    seed_all(1234)
    resumed = make(DataLoaderX)
    assert isinstance(resumed, DataLoaderX)
    resumed.load_state_dict(state)
    set_global_rngs(rngs)  # the checkpoint restores the global RNGs, as for dropout
    try:
        if consumed is None:
            return [*before, got, *(epoch_of(resumed) for _ in range(later))]
        return [*before, got + epoch_of(resumed), *(epoch_of(resumed) for _ in range(later))]
    finally:
        resumed.close()


def resumed_twice(make: Make, epoch: int, first: int, second: int, later: int = 2) -> list[Any]:
    """As `interrupted_and_resumed`, with the resumed loader interrupted again ``second``
    batches further into the epoch (``0``: before its first), and resumed once more."""
    seed_all(0)
    loader = make(DataLoaderX)
    assert isinstance(loader, DataLoaderX)
    before = [epoch_of(loader) for _ in range(epoch)]
    got: list[Any] = []
    for take, seed in ((first, 1234), (second, 99)):
        it = iter(loader)
        got += [plain(next(it)) for _ in range(take)]
        state, rngs = through_disk(loader.state_dict()), global_rngs()
        del it
        loader.close()
        seed_all(seed)
        loader = make(DataLoaderX)
        assert isinstance(loader, DataLoaderX)
        loader.load_state_dict(state)
        set_global_rngs(rngs)
    try:
        return [*before, got + epoch_of(loader), *(epoch_of(loader) for _ in range(later))]
    finally:
        loader.close()
