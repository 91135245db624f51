"""The device stage on a real CUDA device. Every test here is skipped without one."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from prefetchx import DataLoaderX

pytestmark = pytest.mark.cuda

MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_none_means_the_current_cuda_device_with_pinned_memory() -> None:
    loader = DataLoaderX(Images(), batch_size=8)
    assert loader.pin_memory
    x, _, _ = next(iter(loader))
    assert x.device == torch.device("cuda", torch.cuda.current_device())
    loader.close()


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
    for _ in loader:
        break
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
from prefetchx import DataLoaderX
from prefetchx._device import CudaStreams
from tests.test_cuda import Images, MEAN, STD


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
    code = f"PLANT = {plant}\n{_SANITIZED_LOOP}"
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


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
