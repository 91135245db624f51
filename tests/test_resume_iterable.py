"""An IterableDataset resumes where the loop was (#63 item 6): from the dataset's own state or its
iterator's, in this process or in each worker, persistent or not, or fast-forwarded where it has
none; against DataLoader's uninterrupted run in the same test."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX
from tests.resume_cases import (
    Shards,
    build,
    epoch_of,
    interrupted_and_resumed,
    resumed_twice,
    seed_all,
    uninterrupted,
)

N, BATCH = 22, 3
CHECKPOINTS = [0, 1, 3, 7, None]  # before the first batch, mid-epoch, at the end, between
CHECKPOINT_IDS = ["before-first", "first", "mid-epoch", "at-end", "between-epochs"]
LOADERS = [(0, False, 0), (0, False, 3), (2, False, 2), (2, True, 2)]
LOADER_IDS = ["0-workers", "0-workers-thread", "2-workers", "2-persistent"]


def _maker(state: str | None, num_workers: int, persistent: bool, max_prefetch: int) -> Any:
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            # Without workers, a thread's draws would race the loop's: none then.
            Shards(N, state, draw=max_prefetch == 0 or num_workers > 0),
            {"max_prefetch": max_prefetch},
            batch_size=BATCH,
            num_workers=num_workers,
            persistent_workers=persistent,
        )

    return make


@pytest.mark.parametrize("consumed", CHECKPOINTS, ids=CHECKPOINT_IDS)
@pytest.mark.parametrize(("num_workers", "persistent", "max_prefetch"), LOADERS, ids=LOADER_IDS)
@pytest.mark.parametrize("state", ["dataset", "iterator"])
def test_an_iterable_dataset_resumes_from_its_own_state_or_its_iterators(
    state: str, num_workers: int, persistent: bool, max_prefetch: int, consumed: int | None
) -> None:
    # #63 item 6: an IterableDataset resumed mid-epoch only when the dataset object had its own
    # state and num_workers=0; with workers, or with the state on the iterator __iter__
    # returns, the resumed epoch started over (the received batches trained twice). "dataset"
    # also counts its epochs in each worker's copy: with persistent workers a state between
    # epochs saved the main process's copy, and the next epoch was labelled with the old one.
    make = _maker(state, num_workers, persistent, max_prefetch)
    expected = uninterrupted(make, epochs=4)
    assert interrupted_and_resumed(make, epoch=1, consumed=consumed) == expected


@pytest.mark.parametrize("consumed", [3, 7], ids=["mid-epoch", "at-end"])
@pytest.mark.parametrize(("num_workers", "persistent", "max_prefetch"), LOADERS, ids=LOADER_IDS)
def test_an_iterable_dataset_without_state_is_fast_forwarded_saying_so(
    num_workers: int,
    persistent: bool,
    max_prefetch: int,
    consumed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # #63 item 6: one without any state warned and replayed its epoch from the start.
    # StatefulDataLoader fast-forwards it: so does DataLoaderX, with a log line.
    make = _maker(None, num_workers, persistent, max_prefetch)
    expected = uninterrupted(make, epochs=4)
    with caplog.at_level(logging.WARNING, logger="prefetchx"):
        got = interrupted_and_resumed(make, epoch=1, consumed=consumed)
    assert got == expected
    (record,) = [r for r in caplog.records if r.name == "prefetchx"]
    assert f"fast-forwarding {consumed} batches" in record.getMessage()


@pytest.mark.parametrize("end", ["break", "exception", "drop"])
def test_every_way_out_of_the_epoch_leaves_a_state_that_resumes_it(end: str) -> None:
    make = _maker("dataset", 2, False, 2)
    expected = uninterrupted(make, epochs=3)
    assert interrupted_and_resumed(make, epoch=1, consumed=4, later=1, end=end) == expected


def test_a_state_inside_an_epoch_with_other_workers_is_refused_naming_them() -> None:
    # Its epoch interleaves the workers' shards: with 3 workers no batch follows the saved ones.
    seed_all(0)
    expected = epoch_of([next(iter(_maker("dataset", 2, False, 2)(DataLoader)))])
    seed_all(0)
    loader = _maker("dataset", 2, False, 2)(DataLoaderX)
    assert isinstance(loader, DataLoaderX)
    it = iter(loader)
    assert epoch_of([next(it)]) == expected
    state = loader.state_dict()
    it.close()
    other = _maker("dataset", 3, False, 2)(DataLoaderX)
    assert isinstance(other, DataLoaderX)
    with pytest.raises(ValueError, match="num_workers=2; this loader has num_workers=3"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    "consumed", [0, 1, 6, None], ids=["before-first", "first", "at-end", "between"]
)
@pytest.mark.parametrize("state", ["dataset", "iterator", None])
def test_persistent_workers_replay_the_draws_after_their_last_batch_of_an_epoch(
    state: str | None, consumed: int | None
) -> None:
    # With drop_last, each worker draws for items its last, short batch drops: no batch brings
    # the worker's states after those draws, and a state taken before its first batch of the
    # next epoch needs them (found by benchmarks/resume_fuzz.py).
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            Shards(N, state),
            batch_size=BATCH,
            drop_last=True,
            num_workers=2,
            persistent_workers=True,
        )

    expected = uninterrupted(make, epochs=4)
    assert len(expected[1]) == 6  # 2 shards of 11: 3 batches of 3 each, 2 items dropped
    assert interrupted_and_resumed(make, epoch=1, consumed=consumed) == expected


@pytest.mark.parametrize(("first", "second"), [(1, 0), (1, 1), (2, 3)])
@pytest.mark.parametrize(
    ("num_workers", "persistent", "max_prefetch"),
    [(0, False, 0), (2, False, 2), (2, True, 2)],
    ids=["0-workers", "2-workers", "2-persistent"],
)
@pytest.mark.parametrize("state", ["dataset", "iterator", None])
def test_a_resumed_epoch_resumes_again_from_a_state_taken_in_it(
    state: str | None,
    num_workers: int,
    persistent: bool,
    max_prefetch: int,
    first: int,
    second: int,
) -> None:
    # A state taken in a resumed epoch holds the saved states of the workers that have not
    # brought a batch since, the worker whose batch comes next, and before the first batch the
    # dataset's state as loaded (a checkpoint every N steps of a resumed run). The fuzz found
    # the next worker taken from the epoch before, and the loaded state not yet set up.
    make = _maker(state, num_workers, persistent, max_prefetch)
    expected = uninterrupted(make, epochs=4)
    assert resumed_twice(make, epoch=1, first=first, second=second) == expected
