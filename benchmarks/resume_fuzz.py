"""Resume fuzz (#63): random resume trials, each against the uninterrupted run.

Each trial draws a loader (dataset kind, length, batch size, ``drop_last``, how it shuffles,
``num_workers``, ``persistent_workers``, ``max_prefetch``), a loop (fast or slow steps, each
drawing from the global RNG as dropout would), a checkpoint (before the first batch, mid-epoch,
in the body of the epoch's last batch, between epochs; taken in the loop's body or after the loop
is left) in epoch 0 or 1, a way out of that epoch (``break``, an exception from the step, a
dropped iterator), and whether the resumed epoch is interrupted again a few batches on and
resumed once more. It runs a plain DataLoader uninterrupted, and DataLoaderX interrupted at the
checkpoint and resumed from it by a new loader in a process whose RNGs start elsewhere (the global
RNGs restored as a checkpoint restores them), and compares every batch of the epochs before, the
resumed epoch and the next two: indices, workers, their seeds and what the dataset drew from
torch's, Python's and numpy's global RNGs (where the dataset is iterated in this process behind a
thread, those draws race the loop's even without a resume, so that dataset draws none).

It prints how many trials differed, by category, and each differing trial; ``--out PATH`` writes
the JSON record. A trial whose state counted other than the batches its loop received (a state
taken after the loop was left) is marked: that is #63 item 1, the stage's count.

Usage:
    python benchmarks/resume_fuzz.py [--trials 1000] [--seed 0] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, get_worker_info

from prefetchx import DataLoaderX
from prefetchx.bench.synthetic import machine_meta

try:
    import numpy as np
except ImportError:
    np = None  # type: ignore[assignment]

KINDS = ("map", "iterable-own-state", "iterable-iterator-state", "iterable-no-state")
CHECKPOINTS = ("before-first", "mid-epoch", "last-batch", "between-epochs")
EXITS = ("break", "exception", "drop")
LATER = 2  # epochs compared after the resumed one
TRIAL_TIMEOUT_S = 120


# --- the datasets -------------------------------------------------------------------------------


def _draws(draw: bool) -> list[int]:
    if not draw:
        return []
    out = [int(torch.randint(0, 10**6, ())), random.randrange(10**6)]
    if np is not None:
        out += [int(np.random.randint(0, 10**6)), round(float(np.random.randn()) * 10**6)]
    return out


def _worker() -> list[int]:
    info = get_worker_info()
    return [-1, -1] if info is None else [info.id, info.seed % 10**6]


class MapItems(Dataset[list[int]]):
    """Item ``i``: ``i``, its worker and seed, and the draws of a random augmentation."""

    def __init__(self, n: int, draw: bool) -> None:
        self.n = n
        self.draw = draw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[int]:
        return [i, *_worker(), *_draws(self.draw)]


class Stream(IterableDataset[list[int]]):
    """``range(n)`` sharded over the workers. ``state``: ``"dataset"`` keeps its position and
    the epochs its copy iterated (shown in each item) in its own ``state_dict()``;
    ``"iterator"`` keeps the position in the iterator ``__iter__`` returns; ``None`` nowhere."""

    def __init__(self, n: int, state: str | None, draw: bool) -> None:
        self.n = n
        self.kind = state
        self.draw = draw
        self.epoch = 0
        self.start = 0
        self.position = 0
        if state == "dataset":
            self.state_dict = lambda: {"position": self.position, "epoch": self.epoch}
            self.load_state_dict = self._load

    def _load(self, state: dict[str, int]) -> None:
        self.start, self.epoch = state["position"], state["epoch"]

    def _items(self) -> list[int]:
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return list(range(first, self.n, step))

    def __iter__(self) -> Iterator[list[int]]:
        if self.kind == "iterator":
            return _StreamIterator(self)
        return self._generate()

    def _generate(self) -> Iterator[list[int]]:
        items = self._items()
        self.position, self.start = self.start, 0
        while self.position < len(items):
            self.position += 1
            label = self.epoch if self.kind == "dataset" else 0
            yield [items[self.position - 1], *_worker(), *_draws(self.draw), label]
        self.position = 0
        self.epoch += 1


class _StreamIterator(Iterator[list[int]]):
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.items = stream._items()
        self.position = 0

    def __next__(self) -> list[int]:
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return [self.items[self.position - 1], *_worker(), *_draws(self.stream.draw), 0]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


# --- one trial ----------------------------------------------------------------------------------


@dataclass
class Trial:
    """What one trial drew, and what came of it."""

    index: int
    kind: str
    length: int
    batch_size: int
    drop_last: bool
    shuffle: str
    num_workers: int
    persistent: bool
    max_prefetch: int
    draws: bool
    step: str
    epoch: int
    checkpoint: str
    where: str
    exit: str
    again: int | None = None
    """Batches the resumed loader takes before a second checkpoint and resume; ``None``: none."""
    consumed: int | None = None
    received: int | None = None
    differs: bool = False
    first_difference: str | None = None
    error: str | None = None
    item1: bool = False
    seconds: float = 0.0
    categories: dict[str, str] = field(default_factory=dict)


def draw_trial(index: int, rng: random.Random, quick: bool) -> Trial:
    kind = rng.choice(KINDS)
    num_workers = rng.choice((0, 2))
    max_prefetch = rng.choice((0, 1, 3))
    shuffles = ("generator", "global", "sampler-generator", "none") if kind == "map" else ()
    return Trial(
        index=index,
        kind=kind,
        length=rng.randint(4, 16 if quick else 40),
        batch_size=rng.randint(1, 4 if quick else 6),
        drop_last=rng.random() < 0.3,
        shuffle=rng.choice(shuffles or ("generator", "global")),
        num_workers=num_workers,
        persistent=num_workers > 0 and rng.random() < 0.5,
        max_prefetch=max_prefetch,
        # Made in this process behind a thread, the dataset's draws race the loop's: none.
        draws=num_workers > 0 or max_prefetch == 0,
        step=rng.choice(("fast", "slow")),
        epoch=rng.choice((0, 1)),
        checkpoint=rng.choice(CHECKPOINTS),
        where=rng.choice(("body", "after")),
        exit=rng.choice(EXITS),
        again=rng.choice((0, 1, 2)) if rng.random() < 0.3 else None,
    )


def _maker(trial: Trial) -> Callable[[type[DataLoader[Any]]], DataLoader[Any]]:
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        dataset: Any
        if trial.kind == "map":
            dataset = MapItems(trial.length, trial.draws)
        else:
            state = {"iterable-own-state": "dataset", "iterable-iterator-state": "iterator"}
            dataset = Stream(trial.length, state.get(trial.kind), trial.draws)
        kwargs: dict[str, Any] = {
            "batch_size": trial.batch_size,
            "drop_last": trial.drop_last,
            "num_workers": trial.num_workers,
            "persistent_workers": trial.persistent,
        }
        if trial.shuffle == "generator":
            kwargs["generator"] = torch.Generator().manual_seed(11)
        if trial.kind == "map" and trial.shuffle in ("generator", "global"):
            kwargs["shuffle"] = True
        if trial.shuffle == "sampler-generator":
            kwargs["sampler"] = RandomSampler(dataset, generator=torch.Generator().manual_seed(3))
        if issubclass(cls, DataLoaderX):
            kwargs["max_prefetch"] = trial.max_prefetch
        return cls(dataset, **kwargs)

    return make


def _plain(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [_plain(b) for b in batch]
    return batch


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def _rngs() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state() if np else None


def _set_rngs(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if np is not None:
        np.random.set_state(states[2])


class StepFailed(Exception):
    """The training step's own exception, as a loop left by an error sees it."""


def _step(trial: Trial, batch: Any) -> Any:
    torch.rand(1)  # dropout's draw
    if trial.step == "slow":
        time.sleep(0.002)
    return _plain(batch)


def _epoch(trial: Trial, loader: Any) -> list[Any]:
    return [_step(trial, batch) for batch in loader]


def run_trial(trial: Trial) -> None:
    """Run ``trial``: DataLoader uninterrupted, DataLoaderX interrupted then resumed."""
    make = _maker(trial)
    _seed(0)
    plain = make(DataLoader)
    expected = [_epoch(trial, plain) for _ in range(trial.epoch + 1 + LATER)]
    del plain
    batches = len(expected[trial.epoch])
    consumed = {
        "before-first": 0,
        "mid-epoch": max(1, batches // 2) if batches > 1 else None,
        "last-batch": batches if batches else None,
        "between-epochs": None,
    }[trial.checkpoint]
    if consumed is None:  # an epoch too short for that checkpoint: between epochs then
        trial.checkpoint = "between-epochs"

    _seed(0)
    loader = make(DataLoaderX)
    assert isinstance(loader, DataLoaderX)
    got = [_epoch(trial, loader) for _ in range(trial.epoch)]
    received: list[Any] = []
    state: dict[str, Any] = {}
    rngs: tuple[Any, ...] = ()

    def checkpoint() -> None:
        nonlocal state, rngs
        state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint brings back
        rngs = _rngs()

    it: Any = iter(loader)
    if consumed == 0:
        checkpoint()
    elif consumed is None:
        received = [_step(trial, batch) for batch in it]
        checkpoint()
    else:
        try:
            for batch in it:
                received.append(_step(trial, batch))
                if len(received) == consumed:
                    if trial.where == "body":
                        checkpoint()
                    if trial.exit == "exception":
                        raise StepFailed
                    break
        except StepFailed:
            pass
        if trial.exit != "drop":
            it = None  # the loop's iterator, gone with the loop
        if trial.where == "after":
            checkpoint()
    if trial.exit == "drop":
        del it
    trial.consumed, trial.received = state["consumed"], len(received)
    trial.item1 = state["epoch_in_progress"] and state["consumed"] != len(received)
    loader.close()

    _seed(1234)
    resumed = make(DataLoaderX)
    assert isinstance(resumed, DataLoaderX)
    resumed.load_state_dict(state)
    _set_rngs(rngs)
    ended = False
    if trial.again is not None and consumed is not None:
        resumed, ended = _again(trial, make, resumed, received)
    if consumed is None or ended:
        got += [received]
    else:
        got += [received + _epoch(trial, resumed)]
    got += [_epoch(trial, resumed) for _ in range(LATER)]
    resumed.close()
    trial.differs = got != expected
    if trial.differs:
        trial.first_difference = _first_difference(got, expected)


def _again(
    trial: Trial,
    make: Callable[[type[DataLoader[Any]]], DataLoader[Any]],
    resumed: DataLoaderX[Any],
    received: list[Any],
) -> tuple[DataLoaderX[Any], bool]:
    """The resumed epoch interrupted again after ``trial.again`` more batches, and resumed by a
    new loader: the batches it took join ``received``; and whether the epoch ended first."""
    it = iter(resumed)
    target = len(received) + (trial.again or 0)
    ended = False
    while len(received) < target and not ended:
        try:
            received.append(_step(trial, next(it)))
        except StopIteration:
            ended = True
    state, rngs = json.loads(json.dumps(resumed.state_dict())), _rngs()
    del it
    resumed.close()
    _seed(99)
    again = make(DataLoaderX)
    assert isinstance(again, DataLoaderX)
    again.load_state_dict(state)
    _set_rngs(rngs)
    return again, ended


def _first_difference(got: list[Any], expected: list[Any]) -> str:
    for e, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            if len(a) != len(b):
                return f"epoch {e}: {len(a)} batches, uninterrupted {len(b)}"
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if x != y:
                    return f"epoch {e} batch {i}: {x} vs uninterrupted {y}"
    return f"{len(got)} epochs, uninterrupted {len(expected)}"


CATEGORIES = (
    "kind",
    "num_workers",
    "persistent",
    "max_prefetch",
    "shuffle",
    "drop_last",
    "step",
    "checkpoint",
    "where",
    "exit",
    "again",
)


def summarize(trials: list[Trial]) -> dict[str, Any]:
    """Trials and differing trials, in all and by each category's values."""
    by: dict[str, dict[str, list[int]]] = {}
    for name in CATEGORIES:
        counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for trial in trials:
            value = str(getattr(trial, name))
            counts[value][0] += 1
            counts[value][1] += trial.differs or trial.error is not None
        by[name] = dict(sorted(counts.items()))
    failed = [t for t in trials if t.differs or t.error is not None]
    return {
        "trials": len(trials),
        "differing": len(failed),
        "differing_item1": sum(t.item1 for t in failed),
        "errors": sum(t.error is not None for t in trials),
        "by_category": by,
    }


def report(summary: dict[str, Any], trials: list[Trial], seconds: float) -> str:
    lines = [
        f"{summary['trials']} trials in {seconds:.0f} s: {summary['differing']} resumed runs "
        f"differed from the uninterrupted run ({summary['errors']} raised), "
        f"{summary['differing_item1']} of them with a state that counted other than the batches "
        "received (#63 item 1, the thread stage's count)",
        "",
        f"{'category':<14}{'value':<26}{'trials':>7}{'differ':>8}",
    ]
    for name, counts in summary["by_category"].items():
        for value, (n, bad) in counts.items():
            lines.append(f"{name:<14}{value:<26}{n:>7}{bad:>8}")
    for trial in trials:
        if trial.differs or trial.error is not None:
            what = trial.error or trial.first_difference
            lines.append(f"trial {trial.index}: {_brief(trial)}: {what}")
    return "\n".join(lines)


def _brief(trial: Trial) -> str:
    return (
        f"{trial.kind} n={trial.length} bs={trial.batch_size} drop_last={trial.drop_last} "
        f"shuffle={trial.shuffle} workers={trial.num_workers} persistent={trial.persistent} "
        f"max_prefetch={trial.max_prefetch} {trial.step} epoch {trial.epoch} "
        f"{trial.checkpoint} ({trial.where}, {trial.exit}) consumed={trial.consumed} "
        f"received={trial.received} again={trial.again}"
    )


def parser() -> argparse.ArgumentParser:
    parsed = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parsed.add_argument("--trials", type=int, default=None, help="1000, or 12 with --quick")
    parsed.add_argument("--seed", type=int, default=0, help="draws the trials")
    parsed.add_argument("--quick", action="store_true", help="few, small trials")
    parsed.add_argument("--out", metavar="PATH", help="write the JSON record there")
    return parsed


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    count = args.trials if args.trials is not None else (12 if args.quick else 1000)
    if count < 1:
        parser().error(f"--trials must be >= 1, got {count}")
    rng = random.Random(args.seed)
    trials = [draw_trial(i, rng, args.quick) for i in range(count)]
    start = time.monotonic()
    for trial in trials:
        began = time.monotonic()
        faulthandler.dump_traceback_later(TRIAL_TIMEOUT_S, exit=True)  # a hang names itself
        try:
            run_trial(trial)
        except Exception as exc:
            trial.error = f"{type(exc).__name__}: {exc}"
        finally:
            faulthandler.cancel_dump_traceback_later()
        trial.seconds = round(time.monotonic() - began, 3)
    seconds = time.monotonic() - start
    summary = summarize(trials)
    print(report(summary, trials, seconds))
    if args.out:
        record = {
            "meta": {**machine_meta(), "quick": args.quick, "seed": args.seed},
            "seconds": round(seconds, 1),
            "summary": summary,
            "trials": [asdict(t) for t in trials],
        }
        with open(args.out, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
