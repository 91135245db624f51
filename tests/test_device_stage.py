"""The device stage on the CPU, with stream operations faked to check the fences and depth."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from prefetchx._device import Copies
from prefetchx._device_stage import DeviceStage, _outliving
from prefetchx._engine import Failure, Signal
from prefetchx._normalize import Normalize
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import ThreadStage
from tests.fakecuda import FakeCuda
from tests.helpers import forget_hosts


class FakeStreams:
    """Records the stream operations DeviceStage performs, in order.

    Every event is complete at once unless a test says otherwise (``pending``); every tensor is
    on the host unless the test marks it local (``local``).
    """

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.on_side_now = False
        self.events = 0
        self.timings = 0
        self.pending: set[int] = set()
        self.local: list[torch.Tensor] = []
        self.side = "side"

    def consumer(self) -> str:
        return "consumer"

    def on_side(self, consumer: str) -> contextlib.AbstractContextManager[None]:
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

    def mark(self, stream: str, timing: bool = False) -> int:
        if timing:  # the GPU meter's: numbered apart, negative
            self.timings += 1
            self.log.append(("timing", stream, -self.timings))
            return -self.timings
        assert self.on_side_now
        assert stream == "side"
        self.events += 1
        self.log.append(("mark", self.events))
        return self.events

    def wait(self, stream: str, event: int) -> None:
        self.log.append(("wait", stream, event))

    def protect(self, tensor: torch.Tensor, stream: str) -> None:
        if tensor.layout != torch.strided:
            raise RuntimeError("record_stream reads storage(): sparse tensors have none")
        self.log.append(("protect", int(tensor.flatten()[0]), stream))

    def done(self, event: int) -> bool:
        return event not in self.pending

    def elapsed_s(self, start: int, end: int) -> float:
        assert self.done(end)
        return (start - end) / 1000  # timing events count down: 1 ms a step

    def is_local(self, tensor: torch.Tensor) -> bool:
        return any(tensor is t for t in self.local)

    def copy(self, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        assert self.on_side_now
        return tensor.clone()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def entries(self, *kinds: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] in kinds]


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

    def take_ahead(self) -> Any:
        return self.take(block=False)

    def take(self, block: bool = True) -> Any:
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
        copies=streams or Copies(torch.device("cpu")),  # type: ignore[arg-type]
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
    assert [entry for entry in streams.log if entry[0] != "timing"] == [
        # batch 0: wait for the consumer, copy on the side stream, event after
        ("side_waits_for", "consumer"),
        ("enter_side",),
        ("mark", 1),
        ("exit_side",),
        # handed over: the consumer waits for batch 0's event only; both tensors protected
        ("wait", "consumer", 1),
        ("protect", 0, "consumer"),
        ("protect", 0, "consumer"),
        # batch 1 starts while the caller works on batch 0
        ("side_waits_for", "consumer"),
        ("enter_side",),
        ("mark", 2),
        ("exit_side",),
        ("wait", "consumer", 2),
        ("protect", 1, "consumer"),
        ("protect", 1, "consumer"),
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
    thread = ThreadStage(Flaky(12, fail_at=5), max_prefetch)
    stage = _stage(thread, FakeStreams(), depth=depth)
    assert _outcomes(stage) == expected
    assert thread.ended


def test_a_source_already_on_the_device_is_not_copied_and_protected_for_the_side_stream() -> None:
    # Its owner (the caller's stream) may drop it once the batch is queued; the side stream
    # still has to read it for the normalization.
    streams = FakeStreams()
    batches = [(torch.full((1, 3, 2, 2), i, dtype=torch.uint8), torch.tensor([i])) for i in (7, 8)]
    streams.local = [x for batch in batches for x in batch]
    normalize = Normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    stage = _stage(Upstream(iter(batches)), streams, normalize=normalize)
    image, label = next(stage)
    assert label is batches[0][1]  # on the device already: no copy
    assert torch.equal(image, batches[0][0].float())
    side = streams.log[: streams.log.index(("mark", 1))]
    assert ("protect", 7, "side") in side  # the input the side stream read, before its event
    assert streams.entries("protect").count(("protect", 7, "side")) == 1
    stage.close()


def test_a_local_source_without_normalization_never_touches_the_side_stream() -> None:
    streams = FakeStreams()
    batches = [(torch.full((1, 3, 2, 2), i, dtype=torch.uint8), torch.tensor([i])) for i in (1, 2)]
    streams.local = [x for batch in batches for x in batch]
    out = list(_stage(Upstream(iter(batches)), streams))
    assert all(o[0] is b[0] and o[1] is b[1] for o, b in zip(out, batches, strict=True))
    assert not [e for e in streams.entries("protect") if e[2] == "side"]


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_leaf_is_protected_through_its_dense_parts(layout: str) -> None:
    dense = torch.tensor([[0.0, 5.0], [6.0, 0.0]])
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    streams = FakeStreams()
    stage = _stage(Upstream(iter([(torch.zeros(1, 3, 2, 2), sparse)])), streams)
    _, got = next(stage)
    assert got.layout == sparse.layout
    assert torch.equal(got.to_dense(), dense)
    protected = [e for e in streams.entries("protect") if e[2] == "consumer"]
    assert len(protected) == (1 + 2 if layout == "coo" else 1 + 3)  # input, then the parts
    stage.close()


def _host_batches(n: int, refs: list[weakref.ref[torch.Tensor]]) -> Iterator[Any]:
    def make(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((1, 3, 2, 2), i, dtype=torch.uint8)
        refs.append(weakref.ref(x))
        return x, torch.tensor([i])

    for i in range(n):
        yield make(i)  # not bound here: the generator's frame keeps no batch


def test_a_host_batch_lives_until_its_copy_is_done() -> None:
    # Memory torch's host allocator does not manage (a buffer the user pinned) must outlive the
    # copy from it; the stage cannot tell which memory that is, so it keeps every host batch.
    streams = FakeStreams()
    streams.pending = {1, 2, 3}  # no copy has finished
    refs: list[weakref.ref[torch.Tensor]] = []
    stage = _stage(Upstream(_host_batches(4, refs)), streams, depth=1)
    next(stage)
    next(stage)
    gc.collect()
    assert [r() is not None for r in refs] == [True, True, True]  # 0, 1 handed, 2 in flight
    streams.pending = {3, 4}  # batches 0 and 1 copied; 2 and 3 (in flight next) not yet
    next(stage)
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, True, True]
    stage.close()  # copies of 2 (handed over) and 3 (in flight) still running: kept
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, True, True]
    streams.pending = set()
    _stage(Upstream(iter([])), streams).close()  # any later stage lets go of finished copies
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, False, False]


def test_the_gpu_meter_reads_completed_events_only() -> None:
    streams = FakeStreams()
    stage = _stage(Upstream(_batches(6)), streams, depth=1)
    next(stage)
    timings = streams.entries("timing")
    assert timings == [("timing", "consumer", -1), ("timing", "consumer", -2)]
    streams.pending = {-4, -6}  # batch 1's and 2's hand-over events not done
    next(stage)
    next(stage)
    stats = stage.stats
    assert stats.gpu_warmup_s == pytest.approx(0.001)  # batch 0: first, apart
    assert stats.gpu_idle.count == 0
    streams.pending = set()
    assert stats.gpu_idle.count == 2  # read when the meter is read, never waited for
    assert stats.gpu_idle.total == pytest.approx(0.002)
    list(stage)
    assert stats.gpu_idle.count == 5
    out = stats.as_dict()
    assert out["gpu_idle_total_s"] == pytest.approx(0.005)
    assert out["gpu_idle_p95_s"] == pytest.approx(0.001)


def test_without_streams_there_is_no_gpu_meter() -> None:
    stage = _stage(Upstream(_batches(3)), None)
    list(stage)
    assert stage.stats.gpu_idle.count == 0
    assert math.isnan(stage.stats.as_dict()["gpu_idle_fraction"])


# --- The real stage against a model of CUDA's streams and caching allocators (tests/fakecuda.py).
# The consumer never completes its work: every batch is dropped while its step is still queued,
# the worst case for memory reuse. The model reports what could race on a real GPU.


@pytest.fixture(autouse=True)
def _no_copies_outlive_the_test() -> Iterator[None]:
    yield
    _outliving.clear()  # records of closed stages, over events of a model that is gone


def _model_stage(fake: FakeCuda, batches: list[Any], depth: int) -> DeviceStage:
    normalize = Normalize((1.0, 2.0, 3.0), (2.0, 2.0, 2.0))
    # What prepare() makes with fill kernels on the caller's stream before the first fence; the
    # model cannot see a factory's device, so it gets them from its own kernel.
    normalize._constants[torch.device("cpu")] = (
        fake.on_device(torch.tensor([1.0, 2.0, 3.0])),
        fake.on_device(torch.tensor([2.0, 2.0, 2.0])),
    )
    return DeviceStage(
        Upstream(_handed_over(batches)),  # type: ignore[arg-type]
        torch.device("cpu"),
        copies=fake,  # type: ignore[arg-type]
        streams=fake,  # type: ignore[arg-type]
        normalize=normalize,
        device_prefetch=depth,
    )


def _handed_over(batches: list[Any]) -> Iterator[Any]:
    """The batches in order, each forgotten once handed over, as a producer does."""
    while batches:
        yield batches.pop(0)


def _images(n: int) -> list[torch.Tensor]:
    return [torch.full((2, 3, 4, 4), i, dtype=torch.uint8) for i in range(n)]


def _expected(i: int) -> torch.Tensor:
    return (torch.full((2, 3, 4, 4), float(i)) - torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)) / 2


def _slow_consumer(fake: FakeCuda, stage: DeviceStage) -> list[torch.Tensor]:
    """Queue a step on every batch and never complete it; return each step's result."""
    results = []
    for x, y in stage:
        results.append(x * 2 + y.float().sum())  # queued on the caller's stream, never run
    return results


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("source", ["pinned", "user-pinned", "on-device"])
def test_against_the_model_nothing_races_under_a_slow_consumer(depth: int, source: str) -> None:
    fake = FakeCuda()
    with fake:
        if source == "pinned":
            batches = [(fake.pin(x), fake.pin(torch.tensor([i]))) for i, x in enumerate(_images(8))]
        elif source == "user-pinned":  # memory the host allocator does not manage
            batches = [
                (fake.user_pinned(x), fake.user_pinned(torch.tensor([i])))
                for i, x in enumerate(_images(8))
            ]
        else:  # made on the device by the caller's stream, dropped by it once queued
            batches = [
                (fake.on_device(x), fake.on_device(torch.tensor([i])))
                for i, x in enumerate(_images(8))
            ]
        stage = _model_stage(fake, batches, depth)
        del batches
        results = _slow_consumer(fake, stage)
        fake.complete_all()
    assert fake.hazards == []
    assert fake.host_syncs == 0
    for i, got in enumerate(results):
        assert torch.equal(got, _expected(i) * 2 + i)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_against_the_model_a_caller_on_its_own_stream_stays_on_it(depth: int) -> None:
    # The stage switches to its side stream and back inside next(): back means the caller's
    # stream, not the default one, and the side waits for the caller's own stream.
    fake = FakeCuda()
    with fake:
        mine = fake.new_stream("mine")
        batches = [(fake.pin(x), fake.pin(torch.tensor([i]))) for i, x in enumerate(_images(6))]
        results, streams = [], []
        with fake.use(mine):
            stage = _model_stage(fake, batches, depth)  # its constants made on `mine`, as prepare()
            del batches
            for x, y in stage:
                streams.append(fake.consumer())
                results.append(x * 2 + y.float().sum())  # queued on `mine`, never run
                x.mul_(0)  # the caller writes to its batch, on its stream
        fake.complete_all()
    assert streams == [mine] * 6
    assert fake.hazards == []
    for i, got in enumerate(results):
        assert torch.equal(got, _expected(i) * 2 + i)


class _Planted(FakeCuda):
    """The model with the stage's protections removed by name."""

    def __init__(self, *removed: str) -> None:
        super().__init__()
        self.removed = set(removed)

    def side_waits_for(self, stream: Any) -> None:
        if "fence" not in self.removed:
            super().side_waits_for(stream)

    def wait(self, stream: Any, event: Any) -> None:
        if "event wait" not in self.removed:
            super().wait(stream, event)

    def protect(self, tensor: torch.Tensor, stream: Any) -> None:
        if "protect" not in self.removed:
            super().protect(tensor, stream)


def _planted(removed: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> _Planted:
    if "keep hosts" in removed:
        forget_hosts(monkeypatch)
    return _Planted(*removed)


def _run_model(fake: FakeCuda, source: str) -> None:
    with fake:
        make = {"pinned": fake.pin, "user-pinned": fake.user_pinned, "on-device": fake.on_device}
        batches = [
            (make[source](x), make[source](torch.tensor([i]))) for i, x in enumerate(_images(8))
        ]
        stage = _model_stage(fake, batches, 1)
        del batches
        _slow_consumer(fake, stage)
        fake.complete_all()


@pytest.mark.parametrize(
    ("source", "removed", "hazard"),
    [
        ("pinned", ("fence", "protect"), "reuse hazard"),
        ("pinned", ("event wait",), "ordering hazard"),
        ("on-device", ("protect", "keep hosts"), "reuse hazard"),
        ("user-pinned", ("keep hosts",), "host hazard"),
    ],
)
def test_against_the_model_each_planted_fault_is_caught(
    source: str, removed: tuple[str, ...], hazard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control for the test above: without it, a quiet model could be a blind one.
    fake = _planted(removed, monkeypatch)
    _run_model(fake, source)
    assert any(line.startswith(hazard) for line in fake.hazards), fake.hazards


@pytest.mark.parametrize(
    ("source", "removed"),
    [
        ("pinned", ("fence",)),
        ("pinned", ("protect",)),
        ("on-device", ("protect",)),
        ("on-device", ("keep hosts",)),
    ],
)
def test_against_the_model_each_protection_alone_keeps_memory_from_reuse(
    source: str, removed: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stage has two protections against each reuse: for a batch it hands over, the fence
    # and record_stream; for a source already on the device, record_stream for the side stream
    # and the host batch it keeps until the copy is done. Either alone suffices with one caller
    # stream; both stay (the fence also orders copies after the caller's writes, record_stream
    # also covers a caller that switches streams).
    fake = _planted(removed, monkeypatch)
    _run_model(fake, source)
    assert not [line for line in fake.hazards if line.startswith("reuse hazard")], fake.hazards
