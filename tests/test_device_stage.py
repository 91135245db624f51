"""The device stage on the CPU, with stream operations faked to check the fences and depth."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from prefetchx._device_stage import DeviceStage
from prefetchx._engine import Failure, Signal
from prefetchx._normalize import Normalize
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import ThreadStage


class FakeStreams:
    """Records the stream operations DeviceStage performs, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.on_side_now = False
        self.events = 0

    def consumer(self) -> str:
        return "consumer"

    def on_side(self) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            self.on_side_now = True
            self.log.append(("enter_side",))
            try:
                yield
            finally:
                self.on_side_now = False
                self.log.append(("exit_side",))

        return ctx()

    def side_waits_for(self, stream: str) -> None:
        self.log.append(("side_waits_for", stream))

    def mark_side(self) -> int:
        assert self.on_side_now
        self.events += 1
        self.log.append(("mark", self.events))
        return self.events

    def wait(self, stream: str, event: int) -> None:
        self.log.append(("wait", stream, event))

    def hand_over(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("hand_over", int(tensor.flatten()[0]), stream))


def _batches(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(n):
        yield torch.full((1, 3, 2, 2), i, dtype=torch.uint8), torch.tensor([i])


class Upstream:
    """A scripted thread stage: outcomes in order (an exception stands for a failed batch), of
    which the first ``ready`` are already waiting when the device stage asks without blocking.

    ``interrupt_at`` makes the blocking take with that index raise KeyboardInterrupt once, as
    Ctrl-C does while the caller waits; the outcome is still there for the next take.
    """

    def __init__(
        self,
        items: Iterator[Any],
        *,
        ready: int = 10**6,
        fail_at: dict[int, BaseException] | None = None,
        interrupt_at: int | None = None,
    ) -> None:
        self.items = items
        self.ready = ready
        self.fail_at = fail_at or {}
        self.interrupt_at = interrupt_at
        self.pulled = 0
        self.stats = EpochStats()
        self.closed = False

    def take(self, block: bool) -> Any:
        if self.closed:
            raise StopIteration
        if not block and self.pulled >= self.ready:
            return Signal.NOT_READY
        if block and self.pulled == self.interrupt_at:
            self.interrupt_at = None
            raise KeyboardInterrupt
        index = self.pulled
        item = next(self.items)  # StopIteration at the end
        self.pulled += 1
        if index in self.fail_at:
            return Failure(self.fail_at[index])
        return item

    def close(self) -> None:
        self.closed = True

    producer_alive = False
    thread = None


def _stage(
    source: Upstream | ThreadStage[Any],
    streams: FakeStreams | None,
    depth: int = 1,
    normalize: Normalize | None = None,
) -> DeviceStage:
    return DeviceStage(
        source,  # type: ignore[arg-type]
        torch.device("cpu"),
        streams=streams,  # type: ignore[arg-type]
        normalize=normalize or Normalize(),
        input_key=0,
        device_prefetch=depth,
    )


def _label(batch: Any) -> int:
    return int(batch[1])


def test_fences_for_each_batch() -> None:
    streams = FakeStreams()
    out = list(_stage(Upstream(_batches(2)), streams))
    assert [int(x[0].flatten()[0]) for x in out] == [0, 1]
    assert streams.log == [
        # batch 0: wait for the consumer, copy on the side stream, event after
        ("side_waits_for", "consumer"),
        ("enter_side",),
        ("mark", 1),
        ("exit_side",),
        # handed over: the consumer waits for batch 0's event only; both tensors protected
        ("wait", "consumer", 1),
        ("hand_over", 0, "consumer"),
        ("hand_over", 0, "consumer"),
        # batch 1 starts while the caller works on batch 0
        ("side_waits_for", "consumer"),
        ("enter_side",),
        ("mark", 2),
        ("exit_side",),
        ("wait", "consumer", 2),
        ("hand_over", 1, "consumer"),
        ("hand_over", 1, "consumer"),
    ]


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_batches_in_flight_are_bounded_by_device_prefetch(depth: int) -> None:
    source = Upstream(_batches(10))
    stage = _stage(source, FakeStreams(), depth=depth)
    for handed in range(1, 11):
        next(stage)
        # Pulled = handed over + in flight, and in flight never exceeds the depth.
        assert source.pulled == min(10, handed + depth)
    with pytest.raises(StopIteration):
        next(stage)


def test_copies_start_only_for_batches_already_waiting() -> None:
    # The thread has nothing ready beyond what the caller asks for: next() hands over the batch
    # it has at once instead of waiting for the next host batch to start its copy.
    source = Upstream(_batches(6), ready=0)
    stage = _stage(source, FakeStreams(), depth=3)
    for handed in range(1, 4):
        assert _label(next(stage)) == handed - 1
        assert source.pulled == handed
    source.ready = 5  # the thread catches up: batches 3 and 4 wait, 5 does not yet
    assert _label(next(stage)) == 3
    assert source.pulled == 5  # 3 taken and handed over, 4 copied ahead within the depth
    assert [_label(b) for b in stage] == [4, 5]


def test_consumer_waits_only_for_its_own_batch() -> None:
    streams = FakeStreams()
    stage = _stage(Upstream(_batches(5)), streams, depth=3)
    next(stage)
    next(stage)
    waits = [entry for entry in streams.log if entry[0] == "wait"]
    assert waits == [("wait", "consumer", 1), ("wait", "consumer", 2)]
    stage.close()


def _outcomes(stage: Any) -> list[Any]:
    out: list[Any] = []
    while True:
        try:
            out.append(_label(next(stage)))
        except StopIteration:
            return out
        except BaseException as exc:
            out.append(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_failed_batch_comes_in_its_turn_and_the_next_follows(depth: int) -> None:
    source = Upstream(_batches(6), fail_at={3: KeyError("bad batch 3"), 4: KeyboardInterrupt()})
    stage = _stage(source, FakeStreams(), depth=depth)
    assert _outcomes(stage) == [0, 1, 2, "KeyError: 'bad batch 3'", "KeyboardInterrupt: ", 5]
    assert (stage.tally.count, stage.tally.ended) == (6, True)
    assert (stage.stats.batches, stage.stats.errors) == (4, 2)


def test_ctrl_c_while_waiting_is_raised_at_once_and_loses_nothing() -> None:
    source = Upstream(_batches(5), ready=0, interrupt_at=2)
    stage = _stage(source, FakeStreams(), depth=2)
    assert [_label(next(stage)) for _ in range(2)] == [0, 1]
    with pytest.raises(KeyboardInterrupt):
        next(stage)
    assert [_label(b) for b in stage] == [2, 3, 4]


def test_a_copy_or_normalization_error_is_that_batchs_error() -> None:
    def batches() -> Iterator[Any]:
        yield from _batches(2)
        yield torch.zeros(1, 5, 2, 2, dtype=torch.uint8), torch.tensor([2])  # 5 channels, not 3
        yield from ((x, torch.tensor([i + 3])) for i, (x, _) in enumerate(_batches(2)))

    stage = _stage(Upstream(batches()), FakeStreams(), normalize=Normalize((1, 2, 3), (1, 1, 1)))
    got = _outcomes(stage)
    assert got[:2] == [0, 1]
    assert got[2].startswith("ValueError: `mean`/`std` have 3 channels but the input has 5")
    assert got[3:] == [3, 4]


def test_normalizes_only_the_input_on_the_side_stream() -> None:
    calls: list[bool] = []
    streams = FakeStreams()

    class Spy(Normalize):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(streams.on_side_now)
            return super().__call__(x)

    stage = _stage(Upstream(_batches(2)), streams, normalize=Spy((1.0, 2.0, 3.0), (2.0, 2.0, 2.0)))
    image, label = next(stage)
    assert calls == [True, True]  # batch 0 and the prefetched batch 1, both on the side stream
    assert image.dtype == torch.float32
    assert torch.equal(
        image, (torch.zeros(1, 3, 2, 2) - torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)) / 2
    )
    assert label.dtype == torch.int64
    stage.close()


def test_without_streams_copies_block_and_nothing_is_fenced() -> None:
    out = list(_stage(Upstream(_batches(3)), None))
    assert [int(label) for _, label in out] == [0, 1, 2]


def test_empty_source_and_none_batches() -> None:
    assert list(_stage(Upstream(iter([])), FakeStreams())) == []
    assert list(_stage(Upstream(iter([None, (None, 1)])), FakeStreams())) == [None, (None, 1)]


def test_close_is_idempotent_and_frees_batches_in_flight() -> None:
    source = Upstream(_batches(10))
    stage = _stage(source, FakeStreams(), depth=3)
    next(stage)
    stage.close()
    stage.close()
    assert source.closed
    assert not stage._in_flight
    with pytest.raises(StopIteration):
        next(stage)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_tally_counts_batches_handed_over_not_in_flight(depth: int) -> None:
    stage = _stage(Upstream(_batches(6)), FakeStreams(), depth=depth)
    next(stage)
    next(stage)
    assert stage.tally.count == 2  # however many more are in flight
    assert not stage.tally.ended
    list(stage)
    assert (stage.tally.count, stage.tally.ended) == (6, True)


def test_tally_is_not_ended_by_close() -> None:
    stage = _stage(Upstream(_batches(6)), FakeStreams(), depth=2)
    next(stage)
    stage.close()
    assert list(stage) == []
    assert (stage.tally.count, stage.tally.ended) == (1, False)


class Flaky:
    """Host batches whose call ``fail_at`` raises and the next goes on, as a DataLoader iterator."""

    def __init__(self, n: int, fail_at: int) -> None:
        self.batches = _batches(n)
        self.i = 0
        self.fail_at = fail_at

    def __iter__(self) -> Flaky:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        self.i += 1
        if self.i - 1 == self.fail_at:
            raise ValueError(f"batch {self.fail_at} failed")
        return batch


@pytest.mark.parametrize("max_prefetch", [0, 2])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_over_a_real_thread_stage_the_outcomes_are_the_sources(
    max_prefetch: int, depth: int
) -> None:
    expected = _outcomes(Flaky(12, fail_at=5))
    thread = ThreadStage(Flaky(12, fail_at=5), max_prefetch, adaptive=False)
    stage = _stage(thread, FakeStreams(), depth=depth)
    assert _outcomes(stage) == expected
    assert stage.tally.ended
    assert stage.stats.batches == 11
