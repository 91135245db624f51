"""The CUDA model tells a correct device stage from a racing one, with a consumer that is slow.

Each test drives a few lines of hand-written stage through the `FakeCuda` interface. The consumer
never completes its work unless a test says so: everything it queued is still running when the
stage goes on, which is when a missing fence or protection would corrupt memory on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.fakecuda import Event, FakeCuda, ModelError


def _host(i: int = 0, shape: tuple[int, ...] = (4, 8)) -> torch.Tensor:
    """A uint8 image batch, as a loader produces it on the host."""
    return torch.full(shape, i, dtype=torch.uint8)


def _start(
    fake: FakeCuda,
    source: torch.Tensor,
    *,
    fence: bool = True,
    protect_source: bool = True,
) -> tuple[torch.Tensor, Event]:
    """Queue one batch: copy it on the side stream and normalize it there."""
    if fence:
        fake.side_waits_for(fake.consumer())
    with fake.on_side(fake.consumer()):
        x = fake.copy(source, non_blocking=True)
        if protect_source and x is source:
            fake.protect(x, fake.side)  # a source already on the device is read on side
        y = (x.float() - 1) / 2
        return y, fake.mark(fake.side)


def _hand_over(
    fake: FakeCuda, y: torch.Tensor, event: Event, *, wait: bool = True, protect: bool = True
) -> torch.Tensor:
    """Give a batch to the caller: its stream waits for the batch, which is kept for it."""
    consumer = fake.consumer()
    if wait:
        fake.wait(consumer, event)
    if protect:
        fake.protect(y, consumer)
    return y


def _loop(
    fake: FakeCuda,
    batches: int = 4,
    *,
    fence: bool = True,
    wait: bool = True,
    protect: bool = True,
) -> list[torch.Tensor]:
    """A training loop over a stage with one batch in flight; the consumer never finishes."""
    steps = []
    with fake:
        pending = _start(fake, fake.pin(_host(0)), fence=fence)
        for i in range(1, batches + 1):
            y = _hand_over(fake, *pending, wait=wait, protect=protect)
            # The next copy overlaps the caller's step on this batch.
            pending = _start(fake, fake.pin(_host(i)), fence=fence)
            steps.append(y * 2)
            del y  # the loop variable moves on: the batch dies while its step is queued
    return steps


def _kinds(fake: FakeCuda) -> set[str]:
    return {line.split(":")[0] for line in fake.hazards}


def test_correct_stage_has_no_hazard_and_never_syncs() -> None:
    """(a) Fence, copy and normalize on side, event, wait, protect: nothing to report."""
    fake = FakeCuda()
    steps = _loop(fake)
    assert fake.hazards == []
    assert fake.unprotected_frees == []
    assert fake.host_syncs == 0
    assert fake.default.completed == 0
    assert [float(s[0, 0]) for s in steps] == [(i - 1) / 2 * 2 for i in range(4)]


def test_no_wait_for_the_event_is_an_ordering_hazard() -> None:
    """(b) The consumer reads the batch before the side stream has written it."""
    fake = FakeCuda()
    _loop(fake, wait=False)
    assert _kinds(fake) == {"ordering hazard"}
    assert "default reads a block of side in aten.mul.Tensor" in fake.hazards[0]
    assert "side wrote it in aten.div.Tensor" in fake.hazards[0]


def test_no_protect_and_no_fence_is_a_reuse_hazard() -> None:
    """(c) A batch dies while the consumer's step reads it; nothing keeps the side stream's next
    allocation off its block. Either protection alone is enough, as the allocator works: with
    the fence, the side stream's allocations are queued after the consumer's step."""
    neither = FakeCuda()
    _loop(neither, fence=False, protect=False)
    assert _kinds(neither) == {"reuse hazard"}
    assert neither.hazards[0].startswith(
        "reuse hazard: block of side (128 bytes) freed while default may still read it"
    )

    protect_only = FakeCuda()
    _loop(protect_only, fence=False)
    assert protect_only.hazards == []
    assert protect_only.unprotected_frees == []

    fence_only = FakeCuda()
    _loop(fence_only, protect=False)
    assert fence_only.hazards == []
    # The free itself left the block unprotected, which a consumer on another stream would hit.
    assert len(fence_only.unprotected_frees) == 4
    assert "freed while default may still read it" in fence_only.unprotected_frees[0]


def _local_source(*, protect_source: bool, wait_first: bool = False) -> FakeCuda:
    """A batch already on the device, made by the caller and dropped once it is queued."""
    fake = FakeCuda()
    with fake:
        scratch = fake.on_device(torch.ones(4, 8))
        source = fake.on_device(torch.ones(4, 8))
        y, event = _start(fake, source, protect_source=protect_source)
        if wait_first:
            y = _hand_over(fake, y, event)
        del source  # the producer lets go of it
        step = scratch + 1  # the caller's next allocation on its own stream
        del step, scratch, y
    return fake


def test_a_local_source_needs_protecting_for_the_side_stream() -> None:
    """(d) ``copy`` returns a local source as it is; the side stream reads it. Dropped by its
    owner, its block returns to the caller's stream at once unless the side stream was recorded
    on it, and the caller's next allocation may take it while the side stream still reads."""
    unprotected = _local_source(protect_source=False)
    assert _kinds(unprotected) == {"reuse hazard"}
    assert unprotected.hazards[0].startswith(
        "reuse hazard: block of default (128 bytes) freed while side may still read it"
    )
    assert "(aten.sub.Tensor, side#2, not complete" in unprotected.hazards[0]
    assert unprotected.hazards[0].endswith("aten.add.Tensor on default may reuse it")

    protected = _local_source(protect_source=True)
    assert protected.hazards == []
    assert protected.unprotected_frees == []


def test_a_local_source_dropped_after_the_caller_waited_is_safe() -> None:
    """(d) The model follows the streams, not the calls: once the caller's stream has waited for
    the batch, its reuse of the source's block comes after the side stream's read."""
    fake = _local_source(protect_source=False, wait_first=True)
    assert fake.hazards == []
    assert fake.unprotected_frees == []


def _fence_case(*, fence: bool) -> FakeCuda:
    fake = FakeCuda()
    with fake:
        source = fake.on_device(torch.zeros(4, 8))
        source.add_(1)  # the caller is still writing it
        _start(fake, source, fence=fence)
    return fake


def test_no_fence_while_the_consumer_writes_the_source_is_an_ordering_hazard() -> None:
    """(e) The side stream reads a block the caller's queued work is still writing."""
    unfenced = _fence_case(fence=False)
    assert _kinds(unfenced) == {"ordering hazard"}
    assert "side reads a block of default" in unfenced.hazards[0]
    assert "default wrote it in aten.add_.Tensor" in unfenced.hazards[0]
    assert _fence_case(fence=True).hazards == []


def test_a_side_write_to_a_block_the_consumer_reads_is_an_ordering_hazard() -> None:
    """Write after read: a stage that refills a device buffer in place must wait first."""
    for fence, expected in ((False, {"ordering hazard"}), (True, set())):
        fake = FakeCuda()
        with fake:
            buffer = fake.on_device(torch.zeros(4, 8))
            step = buffer * 2  # the caller reads it
            if fence:
                fake.side_waits_for(fake.consumer())
            with fake.on_side(fake.consumer()):
                buffer.copy_(fake.copy(fake.pin(torch.ones(4, 8)), non_blocking=True))
            del step
        assert _kinds(fake) == expected
        if expected:
            assert "side writes a block of default in aten.copy_.default" in fake.hazards[0]


def _copy_then_free(pinned: str) -> FakeCuda:
    fake = FakeCuda()
    with fake:
        host = _host(1)
        host = fake.pin(host) if pinned == "allocator" else fake.user_pinned(host)
        with fake.on_side(fake.consumer()):
            fake.copy(host, non_blocking=True)
        del host  # freed while the copy is pending
    return fake


def test_a_user_pinned_buffer_freed_during_its_copy_is_a_host_hazard() -> None:
    """(f) The caching host allocator keeps back only the blocks it made."""
    user = _copy_then_free("user")
    assert _kinds(user) == {"host hazard"}
    assert "user-pinned host buffer (32 bytes) was freed" in user.hazards[0]
    assert _copy_then_free("allocator").hazards == []


def test_a_host_buffer_written_during_its_copy_is_a_host_hazard() -> None:
    """A loader's ring buffer refilled while its copy is pending: pinned by whom is no help."""
    fake = FakeCuda()
    with fake:
        host = fake.pin(_host(1))
        with fake.on_side(fake.consumer()):
            fake.copy(host, non_blocking=True)
    host.fill_(7)  # the producer thread's refill, which the mode does not see
    assert _kinds(fake) == {"host hazard"}
    assert "was written while its copy on side (side#1) was pending" in fake.hazards[0]

    done_first = FakeCuda()
    with done_first:
        host = done_first.pin(_host(1))
        with done_first.on_side(done_first.consumer()):
            done_first.copy(host, non_blocking=True)
    done_first.complete(done_first.side)
    host.fill_(7)
    assert done_first.hazards == []


def _sparse_batch(*, protect_parts: bool) -> FakeCuda:
    """A sparse batch read by the caller, dropped, and followed by an unfenced copy."""
    fake = FakeCuda()
    host = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=False
    )
    with fake:
        with fake.on_side(fake.consumer()):
            device = fake.copy(fake.pin(host), non_blocking=True)
        fake.wait(fake.default, fake.mark(fake.side))
        assert fake.is_local(device)
        with pytest.raises(NotImplementedError, match="Cannot access storage of SparseTensorImpl"):
            fake.protect(device, fake.default)
        if protect_parts:
            fake.protect(device._indices(), fake.default)
            fake.protect(device._values(), fake.default)
        step = device.to_dense()  # the caller reads both parts
        del device
        with fake.on_side(fake.consumer()):
            fake.copy(fake.pin(host), non_blocking=True)
        del step
    return fake


def test_protect_refuses_a_sparse_tensor_and_takes_its_parts() -> None:
    """(g) ``record_stream`` reads ``storage()``, which a sparse tensor lacks; its indices and
    values are what needs protecting."""
    unprotected = _sparse_batch(protect_parts=False)
    assert _kinds(unprotected) == {"reuse hazard"}
    assert len(unprotected.hazards) == 2  # indices and values
    assert _sparse_batch(protect_parts=True).hazards == []


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_protect_refuses_a_compressed_sparse_tensor() -> None:
    fake = FakeCuda()
    with fake, fake.on_side(fake.consumer()):
        device = fake.copy(fake.pin(torch.eye(3).to_sparse_csr()), non_blocking=True)
        with pytest.raises(NotImplementedError, match="Cannot access storage"):
            fake.protect(device, fake.default)
        for part in (device.crow_indices(), device.col_indices(), device.values()):
            fake.protect(part, fake.default)


def test_done_and_elapsed_follow_completion_and_waits() -> None:
    """(h) Events complete when the work before them does; a wait holds its stream back."""
    fake = FakeCuda()
    with fake:
        asked = fake.mark(fake.default)  # the loop asks for a batch; its stream is idle
        _, ready = _start(fake, fake.pin(_host()))
        fake.wait(fake.default, ready)
        handed = fake.mark(fake.default)
    assert fake.done(asked)
    assert not fake.done(ready)
    assert not fake.done(handed)
    with pytest.raises(RuntimeError, match="device not ready"):
        fake.elapsed_s(asked, handed)

    fake.advance(0.25)
    assert fake.complete(fake.default) == 0  # held back by its wait for the side stream
    assert not fake.done(handed)
    fake.complete(fake.side, upto=ready)
    assert fake.done(ready)
    assert not fake.done(handed)
    fake.complete(fake.default)
    assert fake.done(handed)
    assert fake.elapsed_s(asked, handed) == pytest.approx(0.25)


def test_complete_all_finishes_every_stream_through_waits() -> None:
    """(h) A chain of waits across three streams: one stream alone cannot complete past it."""
    fake = FakeCuda()
    third = fake.new_stream("third")
    with fake:
        _, ready = _start(fake, fake.pin(_host()))
        fake.wait(third, ready)
        fake.wait(fake.default, fake.mark(third))
    assert fake.complete(fake.default) == 0
    fake.complete_all()
    assert all(s.completed == s.queued for s in (fake.default, fake.side, third))


def _source(fake: FakeCuda, kind: str) -> torch.Tensor:
    if kind == "pinned":
        return fake.pin(_host())
    if kind == "user-pinned":
        return fake.user_pinned(_host())
    if kind == "pinned, not dense":
        return fake.pin(_host())[:, ::2]
    return _host()


@pytest.mark.parametrize(
    ("kind", "non_blocking", "syncs"),
    [
        ("pinned", True, 0),
        ("user-pinned", True, 0),
        ("pageable", True, 1),
        ("pinned, not dense", True, 1),
        ("pinned", False, 1),
    ],
)
def test_a_non_blocking_copy_from_pageable_memory_syncs_the_host(
    kind: str, non_blocking: bool, syncs: int
) -> None:
    """(i) Only pinned, dense memory copies asynchronously; the rest makes the host wait for
    the stream, and through the fence for the caller's queued step."""
    fake = FakeCuda()
    with fake:
        step = fake.on_device(torch.ones(2)) * 2  # the caller's queued work
        fake.side_waits_for(fake.consumer())
        with fake.on_side(fake.consumer()):
            fake.copy(_source(fake, kind), non_blocking=non_blocking)
        del step
    assert fake.host_syncs == syncs
    assert (fake.default.completed == fake.default.queued) == bool(syncs)


def test_reading_a_device_value_on_the_host_syncs() -> None:
    """``.item()`` and ``bool()`` of a device tensor wait for the stream (not on the hot path)."""
    fake = FakeCuda()
    with fake:
        x = fake.on_device(torch.ones(3))
        assert (x * 2).sum().item() == 6.0
        assert bool((x > 0).all())
    assert fake.host_syncs == 2
    assert fake.default.completed == fake.default.queued


def test_the_mode_is_thread_local() -> None:
    """(j) Ops in another thread are not seen: a producer's host work is not device work."""
    fake = FakeCuda()
    seen: list[torch.Tensor] = []

    def producer(y: torch.Tensor) -> None:
        seen.append(y * 2)  # would be an ordering hazard if the mode saw it
        seen.append(torch.ones(2) + 1)

    with fake:
        y, _ = _start(fake, fake.pin(_host()))
        ops_before = len(fake.host_ops)
        thread = threading.Thread(target=producer, args=(y,), name="model-producer")
        thread.start()
        thread.join()
        assert fake.hazards == []
        assert len(fake.host_ops) == ops_before
        torch.ones(2) + 1  # the same host op in the calling thread is seen as host work
        assert fake.host_ops[ops_before:] == ["aten.ones.default", "aten.add.Tensor"]
        y * 2
    assert _kinds(fake) == {"ordering hazard"}


def test_the_host_seeing_an_event_done_orders_later_work_after_it() -> None:
    """Completion alone is timing, which nothing guarantees; a query that saw it is a guarantee
    for what the host queues afterwards."""
    for query, expected in ((False, {"ordering hazard"}), (True, set())):
        fake = FakeCuda()
        with fake:
            y, ready = _start(fake, fake.pin(_host()))
            fake.complete(fake.side)
            if query:
                assert fake.done(ready)
            y * 2
        assert _kinds(fake) == expected


def test_protected_memory_is_held_until_the_consumer_finishes() -> None:
    """``device_bytes_live`` counts what the stage keeps on the device, including a batch the
    caller dropped whose step is still queued."""
    fake = FakeCuda()
    with fake:
        y = _hand_over(fake, *_start(fake, fake.pin(_host())))
        step = y * 2
        held = fake.device_bytes_live
        del y
        assert fake.device_bytes_live == held  # the caller's step may still read it
        fake.complete(fake.side)
        fake.complete(fake.default)
        assert fake.device_bytes_live == held - 128
        del step
    assert fake.device_bytes_live == 0
    # Inside ``(x.float() - 1) / 2``: the uint8 copy and two float32 temporaries at a time.
    assert fake.device_bytes_peak == 32 + 128 + 128


def test_views_share_their_block() -> None:
    """A view keeps its base's block alive and protecting a view protects the block."""
    fake = FakeCuda()
    with fake:
        y = _hand_over(fake, *_start(fake, fake.pin(_host())), protect=False)
        row = y[0]
        fake.protect(row, fake.default)
        step = y * 2
        del y
        assert fake.unprotected_frees == []  # still alive through the view
        del row
        _start(fake, fake.pin(_host()), fence=False)
        del step
    assert fake.hazards == []
    assert fake.unprotected_frees == []


def test_reuse_stays_within_the_stream_and_the_pool() -> None:
    """A freed block is reused only by its stream, and small and large requests use separate
    pools: a 4 MiB block is not a candidate for a 32-byte request, but is for a 2 MiB one."""
    fake = FakeCuda()
    with fake:
        with fake.on_side(fake.consumer()):
            big = fake.copy(fake.pin(torch.zeros(1 << 20)), non_blocking=True)
        fake.wait(fake.default, fake.mark(fake.side))
        step = big * 2
        del big
        other = fake.new_stream("other")
        with fake.use(other):
            fake.on_device(torch.zeros(1 << 20))
        with fake.on_side(fake.consumer()):
            fake.copy(fake.pin(_host()), non_blocking=True)
        assert fake.hazards == []
        with fake.on_side(fake.consumer()):
            fake.copy(fake.pin(torch.zeros(1 << 19)), non_blocking=True)
        del step
    assert _kinds(fake) == {"reuse hazard"}


def test_corrupt_mode_spoils_what_a_race_would() -> None:
    """With ``corrupt=True``, an unordered read and a reused block show up in the values."""
    racing = FakeCuda(corrupt=True)
    unwaited = _loop(racing, wait=False, batches=1)
    assert torch.isnan(unwaited[0]).all()

    reused = FakeCuda(corrupt=True)
    steps = _loop(reused, fence=False, protect=False)
    assert torch.isnan(steps[0]).all()  # its input was overwritten by a later batch

    correct = FakeCuda(corrupt=True)
    assert not any(torch.isnan(s).any() for s in _loop(correct))


def test_a_device_op_on_a_host_tensor_is_a_model_error() -> None:
    """Real CUDA refuses it too, except for a 0-dim CPU tensor, which a kernel takes as a scalar."""
    fake = FakeCuda()
    with fake:
        x = fake.on_device(torch.ones(3))
        assert float((x * torch.tensor(2.0)).sum()) == 6.0
        with pytest.raises(ModelError, match="read host memory"):
            x + torch.ones(3)


def test_copy_of_a_local_tensor_is_the_tensor_itself() -> None:
    """``.to(device)`` returns a tensor already there; no work is queued for it."""
    fake = FakeCuda()
    with fake:
        x = fake.on_device(torch.ones(3))
        queued = fake.default.queued
        assert fake.copy(x, non_blocking=True) is x
        assert fake.default.queued == queued
        assert not fake.is_local(torch.ones(3))
        with pytest.raises(RuntimeError, match="not on the device"):
            fake.protect(torch.ones(3), fake.default)  # record_stream has no CPU kernel


def test_pinning() -> None:
    """``pin`` copies into the host allocator; a pinned tensor comes back as it is; a device
    tensor cannot be pinned; ``pin_memory()`` under the mode goes through the model."""
    fake = FakeCuda()
    host = _host()
    pinned = fake.pin(host)
    assert pinned is not host
    assert fake.is_pinned(pinned)
    assert not fake.is_pinned(host)
    assert fake.pin(pinned) is pinned
    with fake:
        assert fake.is_pinned(host.pin_memory())
        assert host.is_pinned() is False
        assert pinned.is_pinned() is True
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            fake.pin(fake.on_device(torch.ones(2)))
