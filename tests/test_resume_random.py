"""Resume replays every random draw of the resumed epoch: the workers' seeds, what they draw in
the dataset (#63 item 5), and a map-style dataset's own state, against DataLoader's uninterrupted
run in the same test."""

from __future__ import annotations

import ctypes
import random
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from prefetchx import _workers
from tests.resume_cases import (
    Augmented,
    Counted,
    Shards,
    build,
    interrupted_and_resumed,
    np,
    resumed_twice,
    uninterrupted,
)

N, BATCH = 22, 3
BATCHES = 8  # ceil(22 / 3)
CHECKPOINTS = [0, 3, BATCHES, None]  # before the first batch, mid-epoch, at the end, between
CHECKPOINT_IDS = ["before-first", "mid-epoch", "at-end", "between-epochs"]


def _generator(seeded: bool) -> torch.Generator | None:
    return torch.Generator().manual_seed(7) if seeded else None


@pytest.mark.parametrize("consumed", CHECKPOINTS, ids=CHECKPOINT_IDS)
@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent"])
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
def test_workers_get_the_uninterrupted_seeds_and_replay_their_random_draws(
    consumed: int | None, persistent: bool, seeded: bool
) -> None:
    # #63 item 5: the resumed epoch's workers got other seeds than the uninterrupted epoch's
    # (so its augmentations differed), even with the loader's generator and a state taken
    # before the first batch. Each item shows its worker's seed and draws from torch's,
    # Python's and numpy's global RNGs in the worker; the checkpoint is in epoch 1, after the
    # workers drew for a whole epoch (persistent workers keep drawing from there).
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            Augmented(N),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            persistent_workers=persistent,
            generator=_generator(seeded),
        )

    expected = uninterrupted(make, epochs=4)
    assert interrupted_and_resumed(make, epoch=1, consumed=consumed) == expected


@pytest.mark.parametrize("consumed", CHECKPOINTS, ids=CHECKPOINT_IDS)
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
def test_without_workers_the_draws_continue_from_the_restored_global_rngs(
    consumed: int | None, seeded: bool
) -> None:
    # In this process the dataset draws from the global RNGs, which the checkpoint restores;
    # with no thread (max_prefetch=0) they interleave with the loop's as with DataLoader.
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            Augmented(N),
            {"max_prefetch": 0},
            batch_size=BATCH,
            shuffle=True,
            generator=_generator(seeded),
        )

    expected = uninterrupted(make, epochs=4)
    assert interrupted_and_resumed(make, epoch=1, consumed=consumed) == expected


@pytest.mark.parametrize("consumed", CHECKPOINTS, ids=CHECKPOINT_IDS)
@pytest.mark.parametrize(
    ("num_workers", "persistent", "max_prefetch"),
    [(0, False, 0), (0, False, 3), (2, False, 2), (2, True, 2)],
    ids=["0-workers", "0-workers-thread", "2-workers", "2-persistent"],
)
def test_a_map_style_datasets_own_state_is_saved_and_loaded(
    consumed: int | None, num_workers: int, persistent: bool, max_prefetch: int
) -> None:
    # #63 item 5: a map-style dataset with its own state_dict()/load_state_dict() (torchdata's
    # Stateful) was neither saved nor loaded. Each item shows how many its copy made: in this
    # process, or in each worker's copy. With the thread, no draws (they would race the loop's).
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            Counted(N, draw=max_prefetch == 0 or num_workers > 0),
            {"max_prefetch": max_prefetch},
            batch_size=BATCH,
            shuffle=True,
            num_workers=num_workers,
            persistent_workers=persistent,
            generator=_generator(True),
        )

    expected = uninterrupted(make, epochs=4)
    assert interrupted_and_resumed(make, epoch=1, consumed=consumed) == expected


@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent"])
@pytest.mark.parametrize("state", ["dataset", None], ids=["own-state", "no-state"])
def test_an_iterable_datasets_workers_draw_the_next_epochs_seeds_after_a_resume_between_epochs(
    persistent: bool, state: str | None
) -> None:
    # #63 item 5: an IterableDataset's state carried no generator state, so after a resume
    # between epochs the workers' seeds repeated the first epoch's.
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            Shards(N, state),
            batch_size=BATCH,
            num_workers=2,
            persistent_workers=persistent,
            generator=_generator(True),
        )

    expected = uninterrupted(make, epochs=4)
    assert interrupted_and_resumed(make, epoch=1, consumed=None) == expected


@pytest.mark.parametrize(("first", "second"), [(1, 0), (1, 1), (3, 2)])
@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent"])
def test_a_resumed_epoch_resumes_again_with_every_workers_draws(
    persistent: bool, first: int, second: int
) -> None:
    # A state taken in a resumed epoch before a worker brought a batch holds that worker's
    # saved generator states, not none (its next batch would draw as a fresh worker's).
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return build(
            cls,
            Counted(N),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            persistent_workers=persistent,
            generator=_generator(True),
        )

    expected = uninterrupted(make, epochs=4)
    assert resumed_twice(make, epoch=1, first=first, second=second) == expected


@pytest.fixture
def fresh_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A worker's note-taking state, new, in this process; its global generators put back."""
    monkeypatch.setattr(_workers, "_current", _workers._Current())
    saved = _workers.global_rngs()
    yield
    _workers.set_global_rngs(saved)


@pytest.mark.usefixtures("fresh_worker")
@pytest.mark.parametrize("layout_known", [True, False], ids=["raw-state", "getstate"])
def test_a_note_carries_each_generator_state_that_changed_and_only_those(
    layout_known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's note sends a generator's state only where it changed since the last note,
    # read cheaply where Python's generator's layout is found, with getstate() where it is not.
    if not layout_known:
        monkeypatch.setattr(_workers, "_python_offset", -1)
    first = _workers._read_rng()
    assert first[0] == torch.get_rng_state().numpy().tobytes()
    assert first[1] == random.getstate()
    assert _workers._read_rng() == (None, None, None)  # nothing drawn
    torch.rand(())
    assert _workers._read_rng()[0] == torch.get_rng_state().numpy().tobytes()
    random.random()
    assert _workers._read_rng() == (None, random.getstate(), None)
    random.gauss(0.0, 1.0)  # draws two Gaussians' worth, keeps one
    assert _workers._read_rng()[1] == random.getstate()
    kept = random.getstate()
    random.gauss(0.0, 1.0)  # the kept one: no draw, the words and position unchanged
    assert random.getstate() != kept
    assert _workers._read_rng() == (None, random.getstate(), None)
    if np is not None:
        np.random.randint(10)
        noted = _workers._read_rng()
        assert noted[:2] == (None, None)
        assert noted[2] is not None
        assert np.array_equal(noted[2][1], np.random.get_state()[1])


def test_the_raw_state_read_is_the_one_getstate_gives() -> None:
    # Where the layout is found, the bytes read are the generator's position and words, as
    # getstate() gives them, after draws too.
    generator = random.Random(3)
    offset = _workers._python_layout(generator)
    assert offset > 0
    for _ in range(3):
        *words, position = generator.getstate()[1]
        raw = ctypes.string_at(id(generator) + offset, 625 * 4)
        assert raw == struct.pack(f"=i{len(words)}I", position, *words)
        generator.random()
