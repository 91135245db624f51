"""The device stage on a real CUDA device. Every test here is skipped without one."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import threading
import time
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from prefetchx import DataLoaderX, Prefetcher
from prefetchx._device import CudaStreams

pytestmark = pytest.mark.cuda

SANITIZED = bool(os.environ.get("TORCH_CUDA_SANITIZER"))
"""Whether torch's CUDA sanitizer watches this process (it is enabled when torch is imported)."""
unsanitized = pytest.mark.skipif(
    SANITIZED,
    reason="the sanitizer reports this test's planted race itself; its own control is "
    "test_cuda_sanitizer_finds_the_race_of_a_missing_fence",
)

MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, int, str]]):
    """uint8 3x16x16 images with an int label and a name; remembers the thread's device."""

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.devices: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        if threading.current_thread().name == "prefetchx-thread":
            self.devices.add(torch.cuda.current_device())
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g), i, f"n{i}"


def _pair(**kwargs: Any) -> tuple[list[Any], list[Any]]:
    gpu = list(DataLoaderX(Images(), batch_size=8, **kwargs))
    cpu = list(DataLoaderX(Images(), batch_size=8, **{**kwargs, "device": "cpu"}))
    return gpu, cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("device_prefetch", [0, 1, 2])
def test_values_equal_the_cpu_reference(
    dtype: torch.dtype, channels_last: bool, device_prefetch: int
) -> None:
    gpu, cpu = _pair(
        device="cuda",
        mean=MEAN,
        std=STD,
        dtype=dtype,
        channels_last=channels_last,
        device_prefetch=device_prefetch,
    )
    assert len(gpu) == len(cpu) == 3
    for (gx, gy, gn), (cx, cy, cn) in zip(gpu, cpu, strict=True):
        assert gx.device.type == "cuda"
        assert gx.dtype == dtype
        assert gx.is_contiguous(memory_format=torch.channels_last) == channels_last
        torch.testing.assert_close(gx.cpu(), cx)
        assert gy.device.type == "cuda"
        assert gy.dtype == torch.int64
        assert torch.equal(gy.cpu(), cy)
        assert gn == cn


def test_without_normalization_only_the_device_changes() -> None:
    gpu, cpu = _pair(device="cuda")
    for (gx, gy, _), (cx, cy, _) in zip(gpu, cpu, strict=True):
        assert gx.dtype == torch.uint8
        assert torch.equal(gx.cpu(), cx)
        assert torch.equal(gy.cpu(), cy)


def test_none_means_the_current_cuda_device() -> None:
    loader = DataLoaderX(Images(), batch_size=8)
    assert not loader.pin_memory  # DataLoader's default: the thread stage pins
    x, _, _ = next(iter(loader))
    assert x.device == torch.device("cuda", torch.cuda.current_device())
    loader.close()


class Recorded(CudaStreams):
    """The real stream operations, noting whether each host tensor copied was pinned."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.pinned: list[bool] = []
        self.sources: list[int] = []  # the address of each host tensor copied
        self.threads: set[str] = set()

    def copy(self, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        self.pinned.append(tensor.is_pinned())
        self.sources.append(tensor.data_ptr())
        return super().copy(tensor, non_blocking)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        return super().pin(tensor)


@dataclasses.dataclass
class Pair:
    image: torch.Tensor
    label: torch.Tensor


def _pairs(batch: list[tuple[torch.Tensor, int, str]]) -> Pair:
    return Pair(torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch]))


@pytest.mark.parametrize("collate", ["default", "dataclass"])
def test_every_host_leaf_is_pinned_in_the_thread_before_its_copy(collate: str) -> None:
    # DataLoader's own pinning returns dataclass batches unpinned.
    kwargs: dict[str, Any] = {} if collate == "default" else {"collate_fn": _pairs}
    loader = DataLoaderX(Images(), batch_size=8, device="cuda", input_key=0, **kwargs)
    streams = Recorded(torch.device("cuda", torch.cuda.current_device()))
    loader._pipeline._streams = streams
    assert len(list(loader)) == 3
    assert streams.pinned
    assert all(streams.pinned)
    assert streams.threads <= {"prefetchx-thread", threading.main_thread().name}


def test_a_leaf_the_user_pinned_is_copied_from_the_users_memory() -> None:
    # The thread pins every host leaf with pin_memory alone, which hands a leaf pinned already
    # back as it is: no second copy of it in host memory.
    pinned = torch.arange(64, dtype=torch.float32).pin_memory()
    loader = DataLoaderX([pinned, pinned], batch_size=None, device="cuda")
    streams = Recorded(torch.device("cuda", torch.cuda.current_device()))
    loader._pipeline._streams = streams
    got = list(loader)
    assert streams.sources == [pinned.data_ptr()] * 2
    assert all(torch.equal(batch.cpu(), pinned) for batch in got)


def test_pin_memory_false_copies_from_pageable_memory() -> None:
    with pytest.warns(UserWarning, match="pin_memory=False"):
        loader = DataLoaderX(Images(), batch_size=8, device="cuda", pin_memory=False)
    streams = Recorded(torch.device("cuda", torch.cuda.current_device()))
    loader._pipeline._streams = streams
    list(loader)
    assert streams.pinned
    assert not any(streams.pinned)


class OnDevice(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A dataset that returns CUDA tensors, which DataLoader accepts with num_workers=0."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 4, 4), i, dtype=torch.uint8, device="cuda"), i


def test_a_dataset_of_cuda_tensors_works_as_with_dataloader() -> None:
    expected = [(x.float().cpu(), y) for x, y in torch.utils.data.DataLoader(OnDevice(), 4)]
    got = [
        (x.cpu(), y.cpu())
        for x, y in DataLoaderX(OnDevice(), 4, device="cuda", mean=(0, 0, 0), std=(1, 1, 1))
    ]
    assert len(got) == len(expected)
    for (gx, gy), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(gx, ex)
        assert torch.equal(gy, ey)


@pytest.mark.skipif(
    SANITIZED,
    reason="torch's sanitizer fails on sparse tensors (its trace hook raises SystemError)",
)
def test_a_sparse_leaf_reaches_the_device() -> None:
    dense = torch.tensor([[0.0, 5.0], [6.0, 0.0]])

    def collate(batch: list[tuple[torch.Tensor, int, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([b[0] for b in batch]), dense.to_sparse()

    for _, sparse in DataLoaderX(Images(), batch_size=8, device="cuda", collate_fn=collate):
        assert sparse.device.type == "cuda"
        assert torch.equal(sparse.to_dense().cpu(), dense)


def test_one_side_stream_per_loader_for_its_life() -> None:
    loader = DataLoaderX(Images(), batch_size=8, device="cuda")
    list(loader)
    streams = loader._pipeline._streams
    assert streams is not None
    list(loader)
    assert loader._pipeline._streams is streams


def test_reserved_memory_is_flat_across_epochs_and_break_releases_buffers() -> None:
    loader = DataLoaderX(
        Images(64), batch_size=16, device="cuda", mean=MEAN, std=STD, device_prefetch=2
    )
    list(loader)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(10):
        list(loader)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    before = torch.cuda.memory_allocated()
    for _batch in loader:
        break
    del _batch  # the loop variable outlives the loop: batch 0 was kept alive by it
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_gpu_and_the_thread_uses_it() -> None:
    dataset = Images()
    batches = list(DataLoaderX(dataset, batch_size=8, device="cuda:1", mean=MEAN, std=STD))
    assert all(x.device == torch.device("cuda", 1) for x, _, _ in batches)
    assert dataset.devices == {1}


_SANITIZED_LOOP = """
import torch
from prefetchx import DataLoaderX, Prefetcher
from prefetchx._device import CudaStreams
from prefetchx._device_stage import Copying, DeviceStage


class NoFenceAfter(CudaStreams):
    def wait(self, stream, event):
        pass  # planted race: the caller no longer waits for its batch's copy


conv = torch.nn.Conv2d(3, 8, 3).cuda()
for depth in (0, 1, 2):
    loader = DataLoaderX(Images(48), batch_size=8, device="cuda", mean=MEAN, std=STD,
                         device_prefetch=depth)
    if PLANT:
        loader._pipeline._streams = NoFenceAfter(loader._pipeline.target)
    for epoch in range(2):
        for x, y, _ in loader:
            out = conv(x).relu_().sum() + y.sum()
            x.mul_(2)  # the caller writes to the batch too
        torch.cuda.synchronize()
print("ok")
"""


def _sanitized(plant: bool) -> subprocess.CompletedProcess[str]:
    # Imported here: the child loads this file by its path, and must import nothing from `tests`.
    from tests.helpers import by_path, repo_env, run_python

    code = f"PLANT = {plant}\n{by_path(__file__, 'Images', 'MEAN', 'STD')}\n{_SANITIZED_LOOP}"
    return run_python(code, repo_env(TORCH_CUDA_SANITIZER="1"), timeout=300)


def test_cuda_sanitizer_finds_no_stream_race() -> None:
    done = _sanitized(plant=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
    assert "CSAN" not in done.stderr, done.stderr[-4000:]


def test_cuda_sanitizer_finds_the_race_of_a_missing_fence() -> None:
    # The control: without it, a quiet sanitizer could mean a sanitizer that never ran.
    done = _sanitized(plant=True)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "CSAN detected a possible data race" in done.stderr, done.stderr[-4000:]


def test_a_caller_on_its_own_stream_stays_on_it() -> None:
    mine = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch
    _, expected = _pair(device="cuda", mean=MEAN, std=STD)  # the CPU reference
    got = []
    with torch.cuda.stream(mine):
        for x, y, _name in DataLoaderX(
            Images(), batch_size=8, device="cuda", mean=MEAN, std=STD, device_prefetch=2
        ):
            assert torch.cuda.current_stream() == mine
            got.append((x * 1, y))  # on `mine`, which waited for the copy
    torch.cuda.synchronize()
    assert len(got) == len(expected) == 3
    for (x, y), (want_x, want_y, _name) in zip(got, expected, strict=True):
        torch.testing.assert_close(x.cpu(), want_x)
        assert torch.equal(y.cpu(), want_y)


@pytest.mark.parametrize(("max_prefetch", "device_prefetch"), [(0, 0), (2, 1), (2, 3)])
def test_resume_counts_batches_received_not_batches_on_the_device(
    max_prefetch: int, device_prefetch: int
) -> None:
    def make() -> DataLoaderX[Any]:
        return DataLoaderX(
            Images(40),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
            device="cuda",
            max_prefetch=max_prefetch,
            device_prefetch=device_prefetch,
        )

    expected = [labels.tolist() for _, labels, _ in make()]
    loader = make()
    it = iter(loader)
    got = [next(it)[1].tolist() for _ in range(3)]
    state = loader.state_dict()
    it.close()
    assert state["consumed"] == 3
    resumed = make()
    resumed.load_state_dict(state)
    rest = [labels.tolist() for _, labels, _ in resumed]
    assert got + rest == expected


@pytest.mark.adaptive
@pytest.mark.skipif(
    SANITIZED, reason="counts, not streams: 2300 batches, minutes under the sanitizer"
)
@pytest.mark.parametrize("exit_by", ["break", "drop"])
def test_a_state_after_leaving_a_fast_gpu_loop_counts_what_the_loop_received(
    exit_by: str,
) -> None:
    # A GPU loop whose step only queues kernels runs far ahead of the GPU: each batch takes
    # microseconds on the host, and the loader soon parks its thread. A state taken after
    # leaving the loop must count the batches the loop received (#63, item 1), and resume
    # there, with every batch's values the uninterrupted run's.
    def make() -> DataLoaderX[Any]:
        return DataLoaderX(
            Images(1000), batch_size=1, shuffle=True, device="cuda",
            generator=torch.Generator().manual_seed(3), mean=MEAN, std=STD,
        )  # fmt: skip

    weight = torch.randn(16, device="cuda")

    def step(x: torch.Tensor) -> None:
        (x.flatten(1)[:, :16] * weight).sum()  # queued, never waited for

    expected = [(labels.tolist(), x.cpu()) for x, labels, _ in make()]
    loader = make()
    got = []
    it = iter(loader)
    for x, labels, _ in it:
        step(x)
        got.append((labels.tolist(), x.cpu() if len(got) % 97 == 0 else None))
        if len(got) == 700:
            break
    if exit_by == "drop":
        del it
    state = loader.state_dict()
    assert state["consumed"] == 700
    assert loader.stats.batches == 700
    resumed = make()
    resumed.load_state_dict(state)
    got += [(labels.tolist(), x.cpu()) for x, labels, _ in resumed]
    assert [labels for labels, _ in got] == [labels for labels, _ in expected]
    for (_, x), (_, want) in zip(got, expected, strict=True):
        if x is not None:
            assert torch.equal(x, want)


class Planted(CudaStreams):
    """The real stream operations with protections removed, the side stream optionally slowed."""

    def __init__(
        self, device: torch.device, *, protect: bool, fence: bool, side_sleep: int = 0
    ) -> None:
        super().__init__(device)
        self._protects = protect
        self._fences = fence
        self._side_sleep = side_sleep

    def side_waits_for(self, stream: Any) -> None:
        if self._fences:
            super().side_waits_for(stream)
        if self._side_sleep:
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(self._side_sleep)  # type: ignore[no-untyped-call]  # untyped in torch

    def protect(self, tensor: torch.Tensor, stream: Any) -> None:
        if self._protects:
            super().protect(tensor, stream)


class Labelled(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Image i is filled with i % 251, on the host or on the GPU."""

    def __init__(self, n: int, device: str = "cpu") -> None:
        self.n = n
        self.device = device

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 64, 64), i % 251, dtype=torch.uint8, device=self.device), i


SLOW = 20_000_000  # GPU cycles: about 10 ms
"""The consumer (or the side stream) is this much slower than the host, per batch."""


def _corrupted(source: Iterable[Any], batches: int) -> int:
    """Elements that differ from their batch's true values, checked on the GPU by a consumer
    that runs far behind the host, so freed memory is reused under its queued reads."""
    truth = torch.arange(batches * 4, device="cuda").remainder(251).float()
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for step, (x, _) in enumerate(source):
        torch.cuda._sleep(SLOW)  # type: ignore[no-untyped-call]  # untyped in torch
        # Then the consumer's own work: blocks of a host batch's size written with 255, a value
        # no image holds, in whatever freed memory the allocator gives its stream.
        scribbles = [torch.full_like(x, 255, dtype=torch.uint8) for _ in range(8)]
        want = truth[step * 4 : step * 4 + 4].view(-1, 1, 1, 1)
        bad += (x != want).sum()
        del scribbles
    torch.cuda.synchronize()
    return int(bad)


@pytest.mark.parametrize(
    ("protect", "fence", "corrupts"),
    [
        (True, True, False),  # the real stage
        (False, True, False),  # the fence alone orders the side's reuse after the reads
        pytest.param(True, False, False, marks=unsanitized),  # record_stream alone holds it
        # neither: a later batch is copied into memory still being read
        pytest.param(False, False, True, marks=unsanitized),
    ],
)
def test_a_slow_consumer_never_reads_corrupted_values(
    protect: bool, fence: bool, corrupts: bool
) -> None:
    loader = DataLoaderX(
        Labelled(96), batch_size=4, device="cuda", mean=(0, 0, 0), std=(1, 1, 1), device_prefetch=3
    )
    loader._pipeline._streams = Planted(loader._pipeline.target, protect=protect, fence=fence)
    bad = sum(_corrupted(loader, 24) for _ in range(3))
    assert (bad > 0) == corrupts, bad


@pytest.mark.parametrize(
    ("protect", "keep_hosts", "corrupts"),
    [
        (True, True, False),  # the real stage
        (False, True, False),  # the host batch, kept until its copy is done, holds the source
        (True, False, False),  # record_stream for the side stream holds it
        (False, False, True),  # neither: the source's memory is reused under the side's read
    ],
)
def test_a_source_on_the_device_is_read_before_its_memory_is_reused(
    protect: bool, keep_hosts: bool, corrupts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The batches come from the GPU (accelerate's placement, a GPU-resident dataset); the side
    # stream, slowed well past the consumer's own SLOW a batch, normalizes each after its owner
    # has dropped it, while the thread and the consumer allocate on their stream. Two things
    # hold a source: its entry in flight, until the caller's stream has waited for its copy,
    # and `Copying` after that. With `max_prefetch=0` nothing is in flight while the consumer
    # works (the next batch is made when asked), so on an H100 the planted arm could not fail.
    if not keep_hosts:
        # Imported here, as in `_sanitized`: a child loads this file and imports nothing from tests.
        from tests.helpers import forget_hosts

        forget_hosts(monkeypatch)
    plain = torch.utils.data.DataLoader(Labelled(96, "cuda"), batch_size=4)
    prefetcher = Prefetcher(plain, device="cuda", mean=(0, 0, 0), std=(1, 1, 1), device_prefetch=2)
    prefetcher._pipeline._streams = Planted(
        prefetcher._pipeline.target, protect=protect, fence=True, side_sleep=4 * SLOW
    )
    bad = sum(_corrupted(prefetcher, 24) for _ in range(3))
    assert (bad > 0) == corrupts, bad


def test_the_gpu_meter_sees_an_input_bound_gpu_and_a_compute_bound_one() -> None:
    class Slow(Labelled):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            time.sleep(0.002)
            return super().__getitem__(i)

    conv = torch.nn.Conv2d(3, 3, 3, padding=1).cuda()
    for dataset, steps, bound in ((Slow(64), 1, "input-bound"), (Labelled(64), 200, "compute")):
        loader = DataLoaderX(dataset, batch_size=4, device="cuda", mean=(0, 0, 0), std=(1, 1, 1))
        for x, _ in loader:
            for _ in range(steps):
                x = conv(x).relu()
        torch.cuda.synchronize()
        stats = loader.stats
        assert stats.gpu_idle.count >= 10
        assert stats.verdict().startswith(bound), str(stats)


def test_a_producer_stall_does_not_hold_back_a_batch_already_copied() -> None:
    # Batch 1 is copied while the caller has batch 0; the producer then stalls on batch 2. The
    # caller's next() hands batch 1 over without waiting for batch 2.
    class StallsAtTwo(Labelled):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            if i == 2:
                time.sleep(1.0)
            return super().__getitem__(i)

    loader = DataLoaderX(StallsAtTwo(4), batch_size=1, device="cuda", max_prefetch=1)
    it = iter(loader)
    next(it)
    time.sleep(0.3)  # batch 1 is made and copied; the thread is now inside batch 2's stall
    start = time.perf_counter()
    _, label = next(it)
    assert time.perf_counter() - start < 0.5
    assert label.tolist() == [1]
    it.close()
