"""The device stage on the CPU, with stream operations faked to check the fences and depth."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from prefetchx._device_stage import DeviceStage
from prefetchx._normalize import Normalize


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


class Source:
    """An iterator that counts how many batches have been pulled from it."""

    def __init__(
        self,
        items: Iterator[Any],
        fail_after: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.items = items
        self.pulled = 0
        self.fail_after = fail_after
        self.error = error or RuntimeError("source failed")

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> Any:
        if self.pulled == self.fail_after:
            raise self.error
        item = next(self.items)
        self.pulled += 1
        return item


def _stage(
    source: Iterator[Any],
    streams: FakeStreams | None,
    depth: int = 1,
    normalize: Normalize | None = None,
) -> DeviceStage:
    return DeviceStage(
        source,
        torch.device("cpu"),
        streams=streams,  # type: ignore[arg-type]
        normalize=normalize or Normalize(),
        input_key=0,
        device_prefetch=depth,
    )


def test_fences_for_each_batch() -> None:
    streams = FakeStreams()
    out = list(_stage(_batches(2), streams))
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
    source = Source(_batches(10))
    stage = _stage(source, FakeStreams(), depth=depth)
    for handed in range(1, 11):
        next(stage)
        # Pulled = handed over + in flight, and in flight never exceeds the depth.
        assert source.pulled == min(10, handed + depth)
    with pytest.raises(StopIteration):
        next(stage)


def test_consumer_waits_only_for_its_own_batch() -> None:
    streams = FakeStreams()
    stage = _stage(_batches(5), streams, depth=3)
    next(stage)
    next(stage)
    waits = [entry for entry in streams.log if entry[0] == "wait"]
    assert waits == [("wait", "consumer", 1), ("wait", "consumer", 2)]
    stage.close()


def test_source_error_comes_after_the_batches_before_it() -> None:
    source = Source(_batches(10), fail_after=3, error=KeyError("bad batch 3"))
    stage = _stage(source, FakeStreams(), depth=2)
    got = [int(next(stage)[1]) for _ in range(3)]
    assert got == [0, 1, 2]
    with pytest.raises(KeyError, match="bad batch 3"):
        next(stage)
    with pytest.raises(StopIteration):
        next(stage)


def test_keyboard_interrupt_is_raised_at_once() -> None:
    source = Source(_batches(10), fail_after=2, error=KeyboardInterrupt())
    stage = _stage(source, FakeStreams(), depth=2)
    with pytest.raises(KeyboardInterrupt):
        next(stage)


def test_normalizes_only_the_input_on_the_side_stream() -> None:
    calls: list[bool] = []
    streams = FakeStreams()

    class Spy(Normalize):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(streams.on_side_now)
            return super().__call__(x)

    stage = _stage(_batches(2), streams, normalize=Spy((1.0, 2.0, 3.0), (2.0, 2.0, 2.0)))
    image, label = next(stage)
    assert calls == [True, True]  # batch 0 and the prefetched batch 1, both on the side stream
    assert image.dtype == torch.float32
    assert torch.equal(
        image, (torch.zeros(1, 3, 2, 2) - torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)) / 2
    )
    assert label.dtype == torch.int64
    stage.close()


def test_without_streams_copies_block_and_nothing_is_fenced() -> None:
    out = list(_stage(_batches(3), None))
    assert [int(label) for _, label in out] == [0, 1, 2]


def test_empty_source_and_none_batches() -> None:
    assert list(_stage(iter([]), FakeStreams())) == []
    assert list(_stage(iter([None, (None, 1)]), FakeStreams())) == [None, (None, 1)]


def test_close_is_idempotent_and_frees_batches_in_flight() -> None:
    stage = _stage(_batches(10), FakeStreams(), depth=3)
    next(stage)
    stage.close()
    stage.close()
    assert not stage._in_flight
    with pytest.raises(StopIteration):
        next(stage)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_tally_counts_batches_handed_over_not_in_flight(depth: int) -> None:
    stage = _stage(_batches(6), FakeStreams(), depth=depth)
    next(stage)
    next(stage)
    assert stage.tally.count == 2  # however many more are in flight
    assert not stage.tally.ended
    list(stage)
    assert (stage.tally.count, stage.tally.ended) == (6, True)


def test_tally_is_not_ended_by_close_or_an_error() -> None:
    stage = _stage(_batches(6), FakeStreams(), depth=2)
    next(stage)
    stage.close()
    assert list(stage) == []
    assert (stage.tally.count, stage.tally.ended) == (1, False)

    failing = _stage(Source(_batches(6), fail_after=3), FakeStreams(), depth=2)
    with pytest.raises(RuntimeError, match="source failed"):
        list(failing)
    assert (failing.tally.count, failing.tally.ended) == (3, False)
