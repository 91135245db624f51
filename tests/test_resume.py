"""Exact mid-epoch resume: state_dict() / load_state_dict() against an uninterrupted run."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import json
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
)

from prefetchx import DataLoaderX
from tests.helpers import (
    Counting,
    FailingSampler,
    Squares,
    Stream,
    as_lists,
    outcomes,
    wait_until,
)

N, BATCH = 26, 4
BATCHES = 7  # ceil(26 / 4)

Make = Callable[[], DataLoaderX[Any]]


def _through_disk(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint would bring it back: torch.save, then a weights-only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _maker(seeded: bool, **kwargs: Any) -> Make:
    def make() -> DataLoaderX[Any]:
        generator = torch.Generator().manual_seed(5) if seeded else None
        return DataLoaderX(range(N), batch_size=BATCH, shuffle=True, generator=generator, **kwargs)

    return make


def _uninterrupted(make: Make, epochs: int = 3) -> list[list[Any]]:
    torch.manual_seed(0)
    loader = make()
    return [as_lists(loader) for _ in range(epochs)]


def _interrupted(make: Make, consumed: int) -> tuple[list[Any], dict[str, Any], torch.Tensor]:
    """Epoch 0 in full, then ``consumed`` batches of epoch 1; the checkpoint a user would save."""
    torch.manual_seed(0)
    loader = make()
    as_lists(loader)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(consumed)]
    state = _through_disk(loader.state_dict())
    rng = torch.get_rng_state()
    it.close()
    loader.close()
    return got, state, rng


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
@pytest.mark.parametrize(
    ("max_prefetch", "num_workers", "persistent"),
    [(0, 0, False), (2, 0, False), (4, 2, False), (2, 2, True)],
)
@pytest.mark.parametrize("consumed", [0, 3, BATCHES])
def test_resume_yields_the_rest_of_the_epoch_then_the_same_epochs(
    seeded: bool, max_prefetch: int, num_workers: int, persistent: bool, consumed: int
) -> None:
    make = _maker(
        seeded, max_prefetch=max_prefetch, num_workers=num_workers, persistent_workers=persistent
    )
    expected = _uninterrupted(make)
    got, state, rng = _interrupted(make, consumed)
    assert state["consumed"] == consumed
    assert state["epoch_in_progress"]

    torch.manual_seed(1234)  # a new process starts from elsewhere
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # the user's checkpoint restores the global RNG
    rest = as_lists(resumed)
    later = as_lists(resumed)
    resumed.close()

    assert got + rest == expected[1]
    assert len(rest) == BATCHES - consumed
    assert later == expected[2]


def test_resumed_epoch_matches_without_restoring_the_global_rng() -> None:
    make = _maker(seeded=False)
    expected = _uninterrupted(make)
    got, state, _ = _interrupted(make, 2)
    torch.manual_seed(99)
    resumed = make()
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected[1]


def test_resumed_iter_leaves_the_global_rng_alone() -> None:
    _, state, _ = _interrupted(_maker(seeded=False), 2)
    resumed = _maker(seeded=False)()
    resumed.load_state_dict(state)
    before = torch.get_rng_state()
    it = iter(resumed)
    assert torch.equal(torch.get_rng_state(), before)
    it.close()
    fresh = iter(resumed)  # a fresh epoch draws its shuffle seed from the global RNG, as always
    assert not torch.equal(torch.get_rng_state(), before)
    fresh.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_draws_the_global_rng_in_dataloaders_order(num_workers: int) -> None:
    def run(cls: type[DataLoader[Any]]) -> tuple[list[Any], list[float]]:
        torch.manual_seed(3)
        loader = cls(range(30), batch_size=4, shuffle=True, num_workers=num_workers)
        epochs = [as_lists(loader) for _ in range(2)]
        return epochs, torch.rand(3).tolist()  # what the training loop draws next

    assert run(DataLoaderX) == run(DataLoader)


def test_skipped_batches_are_never_loaded() -> None:
    dataset = Counting(N)
    loader = DataLoaderX(dataset, batch_size=BATCH, max_prefetch=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    it.close()

    fresh = Counting(N)
    resumed = DataLoaderX(fresh, batch_size=BATCH, max_prefetch=2)
    resumed.load_state_dict(state)
    rest = as_lists(resumed)
    assert rest[0] == [12, 13, 14, 15]
    assert fresh.produced == N - 3 * BATCH


@pytest.mark.usefixtures("both_modes")
def test_state_counts_batches_received_not_batches_made_ahead() -> None:
    dataset = Counting(40)
    loader = DataLoaderX(dataset, batch_size=BATCH, max_prefetch=4)
    it = iter(loader)
    next(it)
    next(it)
    assert wait_until(lambda: dataset.produced >= 6 * BATCH)  # the thread ran ahead
    assert loader.state_dict()["consumed"] == 2
    it.close()


@pytest.mark.adaptive
@pytest.mark.parametrize("consumed", [300, 701])
def test_state_inside_a_fast_loop(consumed: int) -> None:
    # A loop of no work: the loader soon parks its thread, which made some batches ahead. The
    # state counts what the loop received, whoever made them.
    def make(kind: type[DataLoader[Any]]) -> DataLoader[Any]:
        return kind(range(2000), batch_size=2, shuffle=True, generator=torch.Generator())

    torch.manual_seed(3)
    expected = as_lists(make(DataLoader))
    torch.manual_seed(3)
    loader = make(DataLoaderX)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(consumed)]
    state = loader.state_dict()
    assert state["consumed"] == consumed
    resumed = make(DataLoaderX)
    assert isinstance(resumed, DataLoaderX)
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected


def test_state_after_an_early_break_and_a_dropped_iterator() -> None:
    make = _maker(seeded=True)
    expected = _uninterrupted(make, epochs=1)[0]
    loader = make()
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if len(got) == 3:
            break
    gc.collect()  # the iterator is gone; the loader still knows how far the loop got
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_after_an_error_resumes_after_the_failed_batch(num_workers: int) -> None:
    # The uninterrupted iterator goes on after a failed batch; so does the resumed one.
    def take(loader: DataLoaderX[Any], n: int | None = None) -> list[Any]:
        got: list[Any] = []
        it = iter(loader)
        while n is None or len(got) < n:
            try:
                got.append(next(it)[:, 0].tolist())
            except StopIteration:
                break
            except ValueError as exc:
                got.append("failed")
                traceback.clear_frames(exc.__traceback__)  # see tests.helpers.outcomes
        return got

    expected = take(DataLoaderX(Squares(20, fail_at=10), batch_size=BATCH))
    assert expected[2] == "failed"
    loader = DataLoaderX(Squares(20, fail_at=10), batch_size=BATCH, num_workers=num_workers)
    got = take(loader, 3)  # two batches and the error in place of the third
    state = loader.state_dict()
    assert state["consumed"] == 3
    loader.close()

    resumed = DataLoaderX(Squares(20), batch_size=BATCH, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert got + take(resumed) == expected


@pytest.mark.parametrize(
    ("num_workers", "fail_at", "consumed"),
    [
        (0, 1, 1),
        (0, 1, 3),
        (0, 3, 2),
        (0, 3, 3),
        (0, 3, 5),
        (2, 5, 1),
        (2, 6, 1),
        (2, 6, 2),
        (2, 6, 3),
        (2, 8, 2),
        (2, 8, 5),
    ],
)
def test_state_after_a_sampler_error_resumes_where_dataloader_goes_on(
    num_workers: int, fail_at: int, consumed: int
) -> None:
    # DataLoader asks a sampler that raised again at the next batch; the saved run's loop got
    # the error in place of a batch, so the replay draws past it as the saved run did. With
    # workers, DataLoader draws 4 indices ahead (2 workers, prefetch_factor 2): the error comes
    # in place of the batch received when it drew, and that batch is lost.
    def loader(cls: type[DataLoader[Any]] = DataLoaderX) -> DataLoader[Any]:
        return cls(
            Squares(12),
            sampler=FailingSampler(12, fail_at),
            batch_size=None,
            num_workers=num_workers,
        )

    expected = [value for value, _ in outcomes(iter(loader(DataLoader)))]
    saved = loader()
    got = [value for value, _ in outcomes(iter(saved), consumed)]
    state = saved.state_dict()
    assert state["consumed"] == consumed
    saved.close()

    resumed = loader()
    resumed.load_state_dict(_through_disk(state))
    assert got + [value for value, _ in outcomes(iter(resumed))] == expected


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_state_after_an_iter_that_failed_is_between_epochs(seeded: bool, persistent: bool) -> None:
    # With workers, DataLoader's iter() primes their index queues, so a sampler whose first
    # draw raises makes iter() raise, after the base seed was drawn; the next iter() begins a
    # new epoch and draws it again. A state saved after the failed iter() resumes that way.
    # With persistent workers, the failed iter() is the second epoch's, which resets the
    # iterator the loader keeps.
    def loader(cls: type[DataLoader[Any]], sampler: FailingSampler) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(5) if seeded else None
        return cls(
            Squares(8),
            sampler=sampler,
            num_workers=2,
            generator=generator,
            persistent_workers=persistent,
        )

    def rest(made: DataLoader[Any]) -> tuple[list[Any], float]:
        return [value for value, _ in outcomes(iter(made))], torch.rand(1).item()

    def failed_iter(made: DataLoader[Any], sampler: FailingSampler) -> None:
        if persistent:
            list(made)
        sampler.fail_at = 1
        with pytest.raises(IndexError):
            iter(made)
        sampler.fail_at = 0  # draws count from 1: never fails

    torch.manual_seed(0)
    sampler = FailingSampler(8, fail_at=0)
    plain = loader(DataLoader, sampler)
    failed_iter(plain, sampler)
    expected = rest(plain)

    torch.manual_seed(0)
    sampler = FailingSampler(8, fail_at=0)
    saved = loader(DataLoaderX, sampler)
    failed_iter(saved, sampler)
    state, rng = _through_disk(saved.state_dict()), torch.get_rng_state()
    saved.close()

    resumed = loader(DataLoaderX, FailingSampler(8, fail_at=0))
    torch.set_rng_state(rng)
    resumed.load_state_dict(state)
    assert rest(resumed) == expected
    assert not state["epoch_in_progress"]


class _FirstIsSlow(Dataset[int]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i == 0:
            time.sleep(0.3)  # its worker returns it after several of the other worker's
        return i


@pytest.mark.skipif(
    "in_order" not in inspect.signature(DataLoader).parameters, reason="torch < 2.6"
)
def test_state_inside_an_out_of_order_epoch_restarts_that_epoch() -> None:
    # With in_order=False, DataLoader hands over batches as its workers finish them, so the
    # batches the loop received are not the first ones drawn: skipping as many at the sampler
    # would repeat some and lose others. The resumed epoch warns and starts that same epoch
    # again, so every batch of it comes.
    def loader(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return cls(
            _FirstIsSlow(),
            batch_size=None,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
            num_workers=2,
            in_order=False,
        )

    epoch = sorted(int(b) for b in loader(DataLoader))
    saved = loader(DataLoaderX)
    it = iter(saved)
    got = [int(next(it)) for _ in range(4)]
    state = _through_disk(saved.state_dict())
    it.close()

    resumed = loader(DataLoaderX)
    with pytest.warns(UserWarning, match="in_order=False"):
        resumed.load_state_dict(state)
    again = [int(b) for b in resumed]
    assert sorted(again) == epoch == list(range(16))
    assert set(got) < set(again)

    in_order = DataLoaderX(_FirstIsSlow(), batch_size=None, num_workers=2)
    with pytest.raises(ValueError, match="in_order False there, None here"):
        in_order.load_state_dict(state)


def test_state_after_the_last_batch_and_after_the_epoch() -> None:
    make = _maker(seeded=True)
    expected = _uninterrupted(make, epochs=2)

    loader = make()
    it = iter(loader)
    for _ in range(BATCHES):
        next(it)
    inside = _through_disk(loader.state_dict())  # in the loop body of the last batch
    with pytest.raises(StopIteration):
        next(it)
    after = _through_disk(loader.state_dict())  # after the loop
    assert (inside["epoch_in_progress"], inside["consumed"]) == (True, BATCHES)
    assert (after["epoch_in_progress"], after["consumed"]) == (False, 0)

    resumed = make()
    resumed.load_state_dict(inside)
    assert as_lists(resumed) == []  # the rest of epoch 0: nothing
    assert as_lists(resumed) == expected[1]

    resumed = make()
    resumed.load_state_dict(after)
    assert as_lists(resumed) == expected[1]


def test_state_before_the_first_epoch_changes_nothing() -> None:
    make = _maker(seeded=True)
    state = _through_disk(make().state_dict())
    assert not state["epoch_in_progress"]
    resumed = make()
    resumed.load_state_dict(state)
    assert as_lists(resumed) == _uninterrupted(make, epochs=1)[0]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (2, False), (2, True)], ids=["0", "2", "2p"]
)
@pytest.mark.parametrize("when", ["inside", "between"])
def test_state_is_plain_data_that_survives_json_a_weights_only_load_and_equality(
    num_workers: int, persistent: bool, when: str
) -> None:
    # #63: the state held tensors (generator states), so two loop states compared with ==
    # raised, and JSON could not hold it. The resumed run still matches DataLoader's.
    make = _maker(seeded=True, num_workers=num_workers, persistent_workers=persistent)
    expected = _uninterrupted(make, epochs=2)
    loader = make()
    it = iter(loader)
    got = [next(it).tolist() for _ in range(2)]
    if when == "between":
        got += as_lists(it)
    state = loader.state_dict()
    it.close()
    loader.close()
    plain = (int, float, str, bool, type(None))
    assert all(isinstance(leaf, plain) for leaf in _leaves(state))
    assert json.loads(json.dumps(state)) == state == _through_disk(state)
    assert state == copy.deepcopy(state)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest = as_lists(resumed) if when == "inside" else []
    assert got + rest == expected[0]
    resumed.close()


def test_a_saved_state_does_not_change_as_the_loop_goes_on() -> None:
    loader = _maker(seeded=True)()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    kept = copy.deepcopy(state)
    as_lists(it)
    as_lists(loader)
    assert state["consumed"] == 1
    assert state == kept


def test_resume_with_a_samplers_own_generator_and_replacement() -> None:
    def make() -> DataLoaderX[Any]:
        generator = torch.Generator().manual_seed(11)
        sampler = RandomSampler(range(N), replacement=True, num_samples=40, generator=generator)
        return DataLoaderX(range(N), batch_size=BATCH, sampler=sampler)

    expected = _uninterrupted(make)
    got, state, rng = _interrupted(make, 4)
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert got + as_lists(resumed) == expected[1]
    assert as_lists(resumed) == expected[2]


def test_resume_with_a_distributed_sampler() -> None:
    def make(rank: int = 0) -> DataLoaderX[Any]:
        sampler = DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        return DataLoaderX(range(N), batch_size=BATCH, sampler=sampler)

    expected = as_lists(make())
    loader = make()
    it = iter(loader)
    got = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected

    with pytest.raises(ValueError, match="rank 0 there, 1 here"):
        make(rank=1).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset": range(N + 4)}, "dataset_len 26 there, 30 here"),
        ({"batch_size": BATCH + 1}, "batch_size 4 there, 5 here"),
        ({"drop_last": True}, "drop_last False there, True here"),
        ({"shuffle": False}, "RandomSampler' there, 'torch.utils.data.sampler.SequentialSampler'"),
    ],
)
def test_state_of_another_loader_is_refused(kwargs: dict[str, Any], message: str) -> None:
    loader = _maker(seeded=True)()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    args: dict[str, Any] = {"dataset": range(N), "batch_size": BATCH, "shuffle": True}
    other = DataLoaderX(**{**args, **kwargs})
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_whose_replay_draws_other_indices_is_refused(num_workers: int) -> None:
    _, state, _ = _interrupted(_maker(seeded=True), 3)
    other = DataLoaderX(
        range(N),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=num_workers,
    )
    # Same shape of loader, but the saved epoch's shuffle came from a sampler that is not this
    # one's: the replay notices at the sampler's first draw (with workers while iter() primes
    # them, without at the first next()), before any batch is loaded.
    tampered = {**state, "digest": (state["digest"] + 1) % 2**32}
    other.load_state_dict(tampered)
    it = iter(other) if num_workers == 0 else None
    with pytest.raises(ValueError, match="drew other indices"):
        next(it if it is not None else iter(other))
    if it is not None:  # and nothing follows: those batches would not be the saved run's
        assert list(it) == []


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        ({"epoch": 3}, TypeError, "must be a dict from DataLoaderX.state_dict"),
        ([1, 2], TypeError, "got 'list'"),
        ({"format": "prefetchx.DataLoaderX", "version": 99}, ValueError, "version 99"),
        ({"format": "prefetchx.DataLoaderX", "version": 2}, ValueError, "version 2; this"),
        (
            {"format": "prefetchx.DataLoaderX", "version": 3, "consumed": 2},
            ValueError,
            "lacks loader, epoch_in_progress, rng_states_at_iter, rng_states, rng_seed, digest, "
            "base_seed_next, dataset_state, iterator_state, ended, num_workers, workers, "
            "next_worker, fast_forward",
        ),
    ],
)
def test_malformed_state_is_refused(state: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DataLoaderX(range(N)).load_state_dict(state)


def _good_state() -> dict[str, Any]:
    _, state, _ = _interrupted(_maker(seeded=True), 2)
    return state


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("consumed", "2", r"consumed='2'; it must be an int >= 0"),
        ("consumed", -1, r"consumed=-1; it must be an int >= 0"),
        ("consumed", True, r"consumed=True; it must be an int >= 0"),
        ("epoch_in_progress", "yes", r"`state\['epoch_in_progress'\]` must be a bool, got 'yes'"),
        ("base_seed_next", 1, r"`state\['base_seed_next'\]` must be a bool, got 1"),
        ("digest", -5, r"`state\['digest'\]` must be None or a 32-bit checksum .* got -5"),
        ("digest", "abc", r"`state\['digest'\]` must be None or a 32-bit checksum .* got 'abc'"),
        ("loader", "mine", r"`state\['loader'\]` must be a dict, got 'mine'"),
        ("rng_states", "x", r"`state\['rng_states'\]` must be a list of generator states"),
        ("rng_states", [None, None], r"holds 2 random generator states; this loader's sampler"),
        (
            "rng_states",
            [[0.5, 1.0]],
            r"`state\['rng_states'\]\[0\]` must be a generator state as a list of ints from 0 "
            r"to 255 \(torch.Generator.get_state\(\).tolist\(\)\), got \[0.5, 1.0\]",
        ),
        (
            "rng_states_at_iter",
            [[0] * 7],
            r"`state\['rng_states_at_iter'\]\[0\]` is not a state of a cpu random generator",
        ),
        ("rng_states", ["abc"], r"`state\['rng_states'\]\[0\]` must be a generator .* got 'abc'"),
        ("rng_states", [[256]], r"`state\['rng_states'\]\[0\]` must be a generator .* got \[256\]"),
        ("rng_seed", "x", r"`state\['rng_seed'\]` must be a generator state as a list .* got 'x'"),
        ("num_workers", -2, r"num_workers=-2; it must be an int >= 0"),
        ("workers", [None], r"`state\['workers'\]` must be None or a list of 0 worker states"),
        ("ended", 0, r"`state\['ended'\]` must be a bool, got 0"),
        ("next_worker", None, r"next_worker=None; it must be an int >= 0"),
        ("fast_forward", "no", r"`state\['fast_forward'\]` must be a bool, got 'no'"),
        ("shuffle", True, r"`state` has fields no DataLoaderX state has: shuffle"),
    ],
)
def test_every_malformed_field_is_refused_at_load_naming_it(
    field: str, value: Any, message: str
) -> None:
    state = {**_good_state(), field: value}
    loader = _maker(seeded=True)()
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


def test_an_iterable_dataset_checkpoints_and_restores_between_epochs() -> None:
    def make() -> DataLoaderX[Any]:
        return DataLoaderX(Stream(10), batch_size=2)

    loader = make()
    assert as_lists(loader) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    state = _through_disk(loader.state_dict())
    assert (state["epoch_in_progress"], state["consumed"]) == (False, 0)
    resumed = make()
    resumed.load_state_dict(state)
    assert as_lists(resumed) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]

    it = iter(loader)
    next(it)
    next(it)
    inside = _through_disk(loader.state_dict())
    assert (inside["epoch_in_progress"], inside["consumed"]) == (True, 2)
    assert inside["fast_forward"]  # it has no state of its own
    it.close()
    restarted = make()
    restarted.load_state_dict(inside)
    assert as_lists(restarted) == [[4, 5], [6, 7], [8, 9]]
    with pytest.raises(ValueError, match="`state` lacks epoch_in_progress"):
        make().load_state_dict({k: v for k, v in inside.items() if k != "epoch_in_progress"})
    with pytest.raises(ValueError, match="comes from a different loader: batch_size 2 there"):
        DataLoaderX(Stream(10), batch_size=3).load_state_dict(inside)


def test_len_and_sampler_attributes_are_unchanged() -> None:
    loader = DataLoaderX(range(N), batch_size=BATCH, shuffle=True)
    assert len(loader) == BATCHES
    assert isinstance(loader.sampler, RandomSampler)
    assert loader.batch_sampler is not None
    assert loader.batch_sampler.batch_size == BATCH


def test_a_state_without_a_check_still_resumes_past_a_deep_lookahead() -> None:
    dataset = Counting(200)
    loader = DataLoaderX(dataset, batch_size=2, shuffle=True, max_prefetch=8)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    # The thread fills its queue (8) and holds one more: 9 batches ahead, at least 7 of them
    # past the loop's 3 (it makes more only once the loop leaves fewer than half).
    assert wait_until(lambda: dataset.produced >= 2 * 10)
    state = loader.state_dict()
    it.close()
    assert state["digest"] is not None
    resumed = DataLoaderX(range(200), batch_size=2, shuffle=True, max_prefetch=8)
    resumed.load_state_dict({**state, "digest": None})  # unchecked, as if out of the window
    rest = as_lists(resumed)
    assert sorted(i for batch in got + rest for i in batch) == list(range(200))


# --- what DataLoader draws, and when ------------------------------------------------------------


@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
def test_a_state_taken_at_an_epochs_end_with_persistent_workers_resumes_later_epochs(
    seeded: bool,
) -> None:
    # With persistent workers DataLoader draws no base seed after the first epoch; a resumed
    # loader's first iter() makes a new iterator, which does: the state says so.
    make = _maker(seeded, num_workers=2, persistent_workers=True)
    torch.manual_seed(0)
    loader = make()
    epochs = [as_lists(loader)]
    state = _through_disk(loader.state_dict())
    rng = torch.get_rng_state()
    assert not state["epoch_in_progress"]
    assert not state["base_seed_next"]
    epochs += [as_lists(loader) for _ in range(2)]
    loader.close()

    torch.manual_seed(99)
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    try:
        assert [as_lists(resumed) for _ in range(2)] == epochs[1:]
    finally:
        resumed.close()


class EagerShuffle(torch.utils.data.Sampler[int]):
    """Shuffles in ``__iter__`` itself, from the global RNG, as many custom samplers do."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler", ["eager", "lazy"])
def test_resume_is_exact_whether_the_sampler_draws_in_iter_or_at_its_first_next(
    num_workers: int, sampler: str
) -> None:
    def make() -> DataLoaderX[Any]:
        if sampler == "eager":
            return DataLoaderX(
                range(N), batch_size=BATCH, sampler=EagerShuffle(N), num_workers=num_workers
            )
        return DataLoaderX(range(N), batch_size=BATCH, shuffle=True, num_workers=num_workers)

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    torch.rand(1)  # the caller draws between iter() and the first next()
    expected = as_lists(it)

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    torch.rand(1)
    got = [next(it).tolist() for _ in range(3)]
    state = _through_disk(loader.state_dict())
    it.close()
    torch.manual_seed(42)
    resumed = make()
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected


def test_a_state_taken_before_the_first_next_resumes_the_whole_epoch() -> None:
    # num_workers=0: iter() has drawn DataLoader's base seed, the sampler has not drawn yet.
    make = _maker(seeded=False)
    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    state = _through_disk(loader.state_dict())
    rng = torch.get_rng_state()
    expected = as_lists(it)
    after = torch.rand(2).tolist()

    torch.manual_seed(7)
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert as_lists(resumed) == expected
    assert torch.rand(2).tolist() == after


def test_an_epoch_resumed_from_before_its_first_next_resumes_again_mid_epoch() -> None:
    # Found by benchmarks/resume_fuzz.py. The first state is taken before the sampler's first
    # draw, from the global RNG "as it is"; the resumed epoch draws, the loop takes 2 batches
    # (and draws from the global RNG, as dropout does), and a second state is taken. It must
    # hold the global RNG's state at the resumed epoch's draw, not "as it is" again, which is
    # by then past the loop's draws: the second resume shuffled the rest anew.
    make = _maker(seeded=False)
    torch.manual_seed(0)
    plain = DataLoader(range(N), batch_size=BATCH, shuffle=True)
    expected = []
    for batch in plain:
        expected.append(batch.tolist())
        torch.rand(1)

    def restored(state: dict[str, Any], rng: torch.Tensor, seed: int) -> DataLoaderX[Any]:
        # A new process: its RNG starts elsewhere until the checkpoint restores it.
        torch.manual_seed(seed)
        loader = make()
        loader.load_state_dict(state)
        torch.set_rng_state(rng)
        return loader

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    state = _through_disk(loader.state_dict())
    rng = torch.get_rng_state()
    it.close()

    resumed = restored(state, rng, seed=7)
    it = iter(resumed)
    got = []
    for _ in range(2):
        got.append(next(it).tolist())
        torch.rand(1)
    state = _through_disk(resumed.state_dict())
    rng = torch.get_rng_state()
    it.close()

    for batch in restored(state, rng, seed=9):
        got.append(batch.tolist())
        torch.rand(1)
    assert got == expected


def test_load_into_a_loader_with_running_persistent_workers() -> None:
    make = _maker(seeded=True, num_workers=2, persistent_workers=True)
    expected = _uninterrupted(make)
    got, state, _ = _interrupted(make, 3)
    loader = make()
    try:
        as_lists(loader)  # its persistent iterator exists: the next iter() is a reset
        loader.load_state_dict(state)
        assert got + as_lists(loader) == expected[1]
        assert as_lists(loader) == expected[2]
    finally:
        loader.close()


def test_state_describes_the_iterator_started_last() -> None:
    make = _maker(seeded=True)
    loader = make()
    first = iter(loader)
    next(first)
    second = iter(loader)  # an independent epoch, as with DataLoader
    got = [next(second).tolist() for _ in range(2)]
    next(first)
    state = loader.state_dict()
    assert state["consumed"] == 2
    rest_of_second = as_lists(second)
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert as_lists(resumed) == rest_of_second
    assert sorted(i for batch in got + rest_of_second for i in batch) == list(range(N))


# --- an IterableDataset that keeps its own state (torchdata's convention) ------------------------


class Resumable(torch.utils.data.IterableDataset[int]):
    """``range(n)`` as a stream that knows where it is: ``state_dict``/``load_state_dict``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self.epochs = 0

    def __iter__(self) -> Iterator[int]:
        for i in range(self.position, self.n):
            self.position = i + 1
            yield i
        self.position = 0
        self.epochs += 1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "epochs": self.epochs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position, self.epochs = state["position"], state["epochs"]


@pytest.mark.parametrize("max_prefetch", [0, 2, 5])
@pytest.mark.parametrize("consumed", [0, 1, 3, 7])
def test_an_iterable_dataset_with_its_own_state_resumes_where_the_loop_was(
    max_prefetch: int, consumed: int, both_modes: str
) -> None:
    def make() -> DataLoaderX[Any]:
        return DataLoaderX(Resumable(14), batch_size=2, max_prefetch=max_prefetch)

    expected = as_lists(make())
    loader = make()
    it = iter(loader)
    got = [next(it).tolist() for _ in range(consumed)]
    if max_prefetch and consumed and both_modes == "threaded":
        # The thread runs ahead (switching, it may be parked now): the dataset's state is ahead.
        snapshots = loader._latest.snapshots  # type: ignore[union-attr]
        made = min(consumed + max_prefetch, 7)
        assert wait_until(lambda: snapshots is not None and snapshots._made >= made)
    state = _through_disk(loader.state_dict())
    it.close()
    assert state["dataset_state"] == {"position": 2 * consumed, "epochs": 0}

    resumed = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resumable: no warning
        resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected
    assert as_lists(resumed) == expected  # and the next epoch starts over


@pytest.mark.parametrize("consumed", [1, 3])
def test_a_resumed_iterable_epoch_leaves_the_global_rng_where_dataloaders_run_does(
    consumed: int,
) -> None:
    # DataLoader draws its base seed from the global RNG as an epoch begins, before the state is
    # saved with that RNG's; the resumed iter() must not draw it again.
    torch.manual_seed(0)
    plain = iter(DataLoader(Resumable(8), batch_size=2))
    for _ in range(consumed):
        next(plain)
    saved_rng = torch.get_rng_state()
    rest = [batch.tolist() for batch in plain]
    expected = torch.rand(1)

    torch.manual_seed(0)
    loader = DataLoaderX(Resumable(8), batch_size=2)
    it = iter(loader)
    for _ in range(consumed):
        next(it)
    state = _through_disk(loader.state_dict())
    it.close()
    resumed = DataLoaderX(Resumable(8), batch_size=2)
    resumed.load_state_dict(state)
    torch.set_rng_state(saved_rng)  # with the rest of the checkpoint
    assert as_lists(resumed) == rest
    assert torch.equal(torch.rand(1), expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_datasets_own_state_is_restored_between_epochs(num_workers: int) -> None:
    loader = DataLoaderX(Resumable(6), batch_size=2, num_workers=num_workers)
    as_lists(loader)
    loader.dataset.epochs = 5  # type: ignore[attr-defined]  # what its owner keeps there
    state = _through_disk(loader.state_dict())
    assert state["dataset_state"] == {"position": 0, "epochs": 5}
    resumed = DataLoaderX(Resumable(6), batch_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert resumed.dataset.epochs == 0  # type: ignore[attr-defined]  # applied at the next iter()
    it = iter(resumed)
    # Applied before DataLoader iterates the dataset: in this process, or in the workers' copies.
    assert resumed.dataset.epochs == 5  # type: ignore[attr-defined]
    it.close()


def test_with_workers_an_iterable_datasets_state_inside_an_epoch_is_each_workers() -> None:
    loader = DataLoaderX(Resumable(10), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    # Each worker iterates its own copy: the main process's is as it was, the first worker's
    # is one batch in, the second's has made none the loop received.
    assert state["dataset_state"] == {"position": 0, "epochs": 0}
    first, second = state["workers"]
    assert first["dataset_state"] == {"position": 2, "epochs": 0}
    assert second is None
    assert state["next_worker"] == 1


def test_a_dataset_state_for_a_dataset_without_one_is_refused() -> None:
    loader = DataLoaderX(Resumable(6), batch_size=2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"holds the dataset's own state, but this dataset"):
        DataLoaderX(Stream(6), batch_size=2).load_state_dict(state)


class _OwnIterators(torch.utils.data.Sampler[int]):
    """A sampler that keeps each iterator it hands out."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.handed: list[Iterator[int]] = []

    def __iter__(self) -> Iterator[int]:
        self.handed.append(iter(range(self.n)))
        return self.handed[-1]

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("batch_size", [None, 2])
def test_the_dataloader_iterator_draws_from_the_samplers_own_iterator_as_dataloaders(
    batch_size: int | None,
) -> None:
    # Once the epoch's position is noted, DataLoaderX's sampler hook steps aside: the
    # DataLoader iterator calls the sampler's iterator itself, as DataLoader's does, so that a
    # draw costs the loop nothing more.
    epochs = []
    for loader_class in (DataLoader, DataLoaderX):
        sampler = _OwnIterators(12)
        if batch_size is None:
            loader = loader_class(range(12), sampler=sampler, batch_size=None)
        else:
            loader = loader_class(range(12), sampler=sampler, batch_size=batch_size)
        it = iter(loader)
        first = [torch.as_tensor(next(it)).tolist() for _ in range(3)]
        drawing = it._sampler_iter
        if batch_size is None:
            assert drawing is sampler.handed[-1], loader_class
        else:  # torch's BatchSampler's own generator
            assert drawing.gi_code is BatchSampler.__iter__.__code__, loader_class
        epochs.append(first + [torch.as_tensor(b).tolist() for b in it])
    assert epochs[0] == epochs[1]


# --- #63 item 3: a state no real run can have is refused ----------------------------------------


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (
            {"epoch_in_progress": False},
            r"epoch_in_progress=False \(between epochs\) with consumed=3",
        ),
        ({"base_seed_next": True}, r"epoch_in_progress=True with base_seed_next=True"),
        ({"iterator_state": {"position": 1}}, r"iterator_state=\{'position': 1\} for a map-style"),
        ({"fast_forward": True}, r"fast_forward=True for a map-style dataset"),
        ({"next_worker": 1}, r"next_worker=1 with num_workers=0"),
        ({"rng_seed": "seed"}, r"rng_seed \(the state persistent workers drew their seed from\)"),
    ],
)
def test_a_state_whose_fields_contradict_each_other_is_refused(
    tamper: dict[str, Any], message: str
) -> None:
    # #63 item 3: a mid-epoch state with epoch_in_progress flipped to False was accepted and
    # replayed the batches the loop had received. The real state resumes as DataLoader goes on.
    make = _maker(seeded=True)
    expected = _uninterrupted(make)
    got, state, _ = _interrupted(make, 3)
    loader = make()
    loader.load_state_dict(state)
    assert got + as_lists(loader) == expected[1]
    if tamper.get("rng_seed") == "seed":
        tamper = {"rng_seed": state["rng_states"][0]}
    with pytest.raises(ValueError, match=f"cannot come from a real loader: {message}"):
        make().load_state_dict({**state, **tamper})


def test_a_between_epochs_state_with_a_count_is_refused() -> None:
    make = _maker(seeded=True)
    expected = _uninterrupted(make, epochs=2)
    loader = make()
    assert as_lists(loader) == expected[0]
    state = _through_disk(loader.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    assert as_lists(resumed) == expected[1]
    for tamper in ({"consumed": 2}, {"digest": 7}, {"ended": True}):
        with pytest.raises(ValueError, match="epoch_in_progress=False"):
            make().load_state_dict({**state, **tamper})


# --- #63 item 4: iteration never depends on a dataset's state protocol -------------------------


class _StateAfterIter(torch.utils.data.IterableDataset[int]):
    """Its state lives in what ``__iter__`` sets up: ``state_dict()`` raises before (a common
    shape); ``broken`` makes it raise always, and ``load_state_dict`` raise too."""

    def __init__(self, n: int, broken: bool = False) -> None:
        self.n = n
        self.broken = broken

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        self.items = list(range(first, self.n, step))
        self.position = getattr(self, "start", 0)
        self.start = 0
        while self.position < len(self.items):
            self.position += 1
            yield self.items[self.position - 1]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        if self.broken:
            raise RuntimeError("no state here")
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.broken:
            raise RuntimeError("no state here")
        self.start = state["position"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("broken", [False, True], ids=["after-iter", "always-raises"])
def test_iteration_never_depends_on_the_datasets_state_protocol(
    num_workers: int, broken: bool, both_modes: str
) -> None:
    # #63 item 4: iter(loader) raised AttributeError from dataset.state_dict(), called as the
    # epoch began, for a dataset whose state exists only once __iter__ ran; DataLoader iterates
    # it, and nobody asked for a state.
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        return cls(_StateAfterIter(14, broken), batch_size=2, num_workers=num_workers)

    expected = [as_lists(make(DataLoader)) for _ in range(2)]
    loader = make(DataLoaderX)
    assert [as_lists(loader) for _ in range(2)] == expected
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    if broken:  # asked for, a state that cannot be known is an error that says why
        with pytest.raises(ValueError, match=r"state_dict\(\) raised in .*: RuntimeError: no st"):
            loader.state_dict()
        it.close()
        return
    state = _through_disk(loader.state_dict())
    it.close()
    resumed = make(DataLoaderX)
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected[0]


@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_a_state_after_break_in_a_fast_loop_counts_every_batch_received(max_prefetch: int) -> None:
    # #63 item 1: with num_workers=0 and a loop faster than about 1 ms a batch, a state taken
    # after `break` (the loop's iterator dropped) counted the batches of the stage's last
    # window only: the resumed epoch trained on most of them again.
    def make(cls: type[DataLoader[Any]]) -> DataLoader[Any]:
        kwargs = {"max_prefetch": max_prefetch} if cls is DataLoaderX else {}
        generator = torch.Generator().manual_seed(4)
        return cls(range(2000), batch_size=2, shuffle=True, generator=generator, **kwargs)

    expected = as_lists(make(DataLoader))
    loader = make(DataLoaderX)
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if len(got) == 700:
            break
    state = loader.state_dict()
    resumed = make(DataLoaderX)
    resumed.load_state_dict(state)
    assert got + as_lists(resumed) == expected
