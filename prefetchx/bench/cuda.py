"""GPU benchmarks: device-stage copy bandwidth, and an end-to-end step against other prefetchers.

Timed with CUDA events after a warm-up; medians of rounds; arms interleaved. Runs only where
CUDA is present.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from prefetchx._loader import DataLoaderX
from prefetchx.bench.jpeg import MEAN, STD


class _Repeat(Dataset[torch.Tensor]):
    """The same host tensor ``n`` times: the loader's cost is the copy, nothing else."""

    def __init__(self, tensor: torch.Tensor, n: int) -> None:
        self.tensor = tensor
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensor


def _events_time(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes on the current stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


@dataclass
class CopyResult:
    """Host-to-device bandwidth of the device stage against a raw pinned copy."""

    megabytes: int
    raw_gbps: float
    prefetchx_gbps: float
    ratio: float


def measure_copy(megabytes: int, batches: int = 20, rounds: int = 5) -> CopyResult:
    """Copy ``batches`` pinned uint8 buffers of ``megabytes`` MB: raw side-stream copies vs
    DataLoaderX's device stage (no normalization, no step work)."""
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.empty(megabytes * 2**20, dtype=torch.uint8).pin_memory()
    dest = torch.empty_like(host, device=device)
    side = torch.cuda.Stream(device=device)
    loader: DataLoaderX[torch.Tensor] = DataLoaderX(
        _Repeat(host, batches), batch_size=None, device=device
    )

    def raw() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(batches):
                dest.copy_(host, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    def ours() -> None:
        for batch in loader:
            del batch

    raw()
    ours()  # warm-up: allocator, streams, thread
    times: dict[str, list[float]] = {"raw": [], "prefetchx": []}
    for r in range(rounds):
        for name, fn in (
            [("raw", raw), ("prefetchx", ours)]
            if r % 2 == 0
            else [("prefetchx", ours), ("raw", raw)]
        ):
            times[name].append(_events_time(fn))
    gb = megabytes * 2**20 * batches / 1e9
    raw_gbps = gb / statistics.median(times["raw"])
    ours_gbps = gb / statistics.median(times["prefetchx"])
    return CopyResult(megabytes, raw_gbps, ours_gbps, ours_gbps / raw_gbps)


class _Images(Dataset[tuple[torch.Tensor, int]]):
    """uint8 3x224x224 images made once and served from memory, with labels."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], i % 10


class ApexStylePrefetcher:
    """apex's ``data_prefetcher`` algorithm: a side stream, one batch ahead, float and
    normalize on the side stream, ``wait_stream`` and ``record_stream`` when handing over."""

    def __init__(self, loader: Iterable[Any], device: torch.device) -> None:
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream(device=device)
        self.device = device
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.next: tuple[torch.Tensor, torch.Tensor] | None = None
        self._preload()

    def _preload(self) -> None:
        try:
            x, y = next(self.loader)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            x = x.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
            y = y.to(self.device, non_blocking=True)
        self.next = (x, y)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.next is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            x, y = self.next
            x.record_stream(torch.cuda.current_stream())
            y.record_stream(torch.cuda.current_stream())
            self._preload()
            yield x, y


def timm_style_prefetcher(
    loader: Iterable[Any], device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """timm's ``PrefetchLoader`` algorithm: a new side stream per epoch, copy and normalize
    there, yield the previous batch after ``wait_stream``; no ``record_stream``."""
    stream = torch.cuda.Stream(device=device)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    first = True
    current: tuple[torch.Tensor, torch.Tensor] | None = None
    for x, y in loader:
        with torch.cuda.stream(stream):
            nx = x.to(device, non_blocking=True).float().sub_(mean).div_(std)
            ny = y.to(device, non_blocking=True)
        if not first and current is not None:
            yield current
        first = False
        torch.cuda.current_stream().wait_stream(stream)
        current = (nx, ny)
    if current is not None:
        yield current


@dataclass
class StepResult:
    """End-to-end epoch time of one arm, and its ratio to the data-on-GPU bound."""

    arm: str
    epoch_s: float
    vs_bound: float


def measure_step(
    batches: int = 24, batch_size: int = 64, rounds: int = 5, channels: int = 64
) -> list[StepResult]:
    """A small conv net trained on uint8 3x224x224 batches, fed five ways."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, channels, 7, stride=2, padding=3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(channels, channels, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(channels, channels, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(channels, 10),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    dataset = _Images(batches * batch_size)
    common: dict[str, Any] = {"batch_size": batch_size, "pin_memory": True}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    plain_loader = DataLoader(dataset, **common)
    ours: DataLoaderX[Any] = DataLoaderX(dataset, device=device, mean=MEAN, std=STD, **common)
    on_gpu = [((x.to(device).float() - mean) / std, y.to(device)) for x, y in plain_loader]

    def plain() -> None:
        for x, y in plain_loader:
            step(
                (x.to(device, non_blocking=True).float() - mean) / std,
                y.to(device, non_blocking=True),
            )

    def apex() -> None:
        for x, y in ApexStylePrefetcher(plain_loader, device):
            step(x, y)

    def timm() -> None:
        for x, y in timm_style_prefetcher(plain_loader, device):
            step(x, y)

    def prefetchx() -> None:
        for x, y in ours:
            step(x, y)

    def bound() -> None:
        for x, y in on_gpu:
            step(x, y)

    arms = {
        "plain": plain,
        "apex-style": apex,
        "timm-style": timm,
        "prefetchx": prefetchx,
        "data-on-gpu": bound,
    }
    for fn in arms.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            torch.cuda.synchronize()
            times[name].append(_events_time(arms[name]))
    bound_s = statistics.median(times["data-on-gpu"])
    return [
        StepResult(name, statistics.median(t), statistics.median(t) / bound_s)
        for name, t in times.items()
    ]
