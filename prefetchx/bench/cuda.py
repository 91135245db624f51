"""GPU benchmarks: the device stage's copy bandwidth, whether the caller blocks, an end-to-end
step against other prefetchers, and the GPU stall meter's cost and accuracy.

Timed with CUDA events; medians of rounds; arms interleaved. Runs only where CUDA is present.
Every arm that needs a loader gets the same one (the same workers, pinning and batches), so the
arms differ only in how batches reach the GPU.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from prefetchx._device import CudaStreams
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


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _events_time(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes on the current stream, by CUDA events."""
    start, end = _event(), _event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


@dataclass
class CopyResult:
    """Host-to-device bandwidth of the device stage against a raw pinned copy on a side stream,
    both timed from the end of the first batch's copy to the end of the last (start-up left out)."""

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

    def raw() -> float:
        consumer = torch.cuda.current_stream()
        side.wait_stream(consumer)
        with torch.cuda.stream(side):
            dest.copy_(host, non_blocking=True)
        consumer.wait_stream(side)
        start, end = _event(), _event()
        start.record()
        side.wait_stream(consumer)
        with torch.cuda.stream(side):
            for _ in range(batches - 1):
                dest.copy_(host, non_blocking=True)
        consumer.wait_stream(side)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def ours() -> float:
        start, end = _event(), _event()
        for i, batch in enumerate(loader):
            if i == 0:
                start.record()  # after the stream's wait for the first batch
            del batch
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    raw()
    ours()  # warm-up: allocator, streams, thread
    times: dict[str, list[float]] = {"raw": [], "prefetchx": []}
    arms = {"raw": raw, "prefetchx": ours}
    for r in range(rounds):
        for name in ("raw", "prefetchx") if r % 2 == 0 else ("prefetchx", "raw"):
            times[name].append(arms[name]())
    gb = megabytes * 2**20 * (batches - 1) / 1e9
    raw_gbps = gb / statistics.median(times["raw"])
    ours_gbps = gb / statistics.median(times["prefetchx"])
    return CopyResult(megabytes, raw_gbps, ours_gbps, ours_gbps / raw_gbps)


@dataclass
class BlockingResult:
    """How long ``next()`` holds the caller while its stream is still busy, pinned vs pageable.

    The caller queues ``busy_ms`` of GPU work, then asks for a batch whose copy is not started
    yet (``device_prefetch=0``). From pinned memory the copy is queued behind the fence and
    ``next()`` returns at once; from pageable memory the copy is synchronous, so the caller waits
    for its own queued work first.
    """

    megabytes: int
    busy_ms: float
    pinned_next_ms: float
    pageable_next_ms: float


def measure_blocking(megabytes: int = 64, busy_ms: float = 50.0, rounds: int = 5) -> BlockingResult:
    """Host time of ``next()`` behind ``busy_ms`` of queued GPU work, pinned vs pageable."""
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.full((megabytes * 2**20,), 7, dtype=torch.uint8)
    cycles = _cycles_per_ms() * busy_ms
    times: dict[str, list[float]] = {"pinned": [], "pageable": []}
    for r in range(rounds):
        for name in ("pinned", "pageable") if r % 2 == 0 else ("pageable", "pinned"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pin_memory=False warns: that is the point
                loader: DataLoaderX[torch.Tensor] = DataLoaderX(
                    _Repeat(host, 3),
                    batch_size=None,
                    device=device,
                    device_prefetch=0,
                    pin_memory=name == "pinned",
                )
            it = iter(loader)
            next(it)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(cycles))
            start = time.perf_counter()
            next(it)
            times[name].append((time.perf_counter() - start) * 1e3)
            it.close()
            torch.cuda.synchronize()
    return BlockingResult(
        megabytes,
        busy_ms,
        statistics.median(times["pinned"]),
        statistics.median(times["pageable"]),
    )


def _cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured."""
    cycles = 10_000_000
    start, end = _event(), _event()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / float(start.elapsed_time(end))


class _Images(Dataset[tuple[torch.Tensor, int]]):
    """uint8 3x224x224 images made once and served from memory, with labels; optionally slow."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.images[i], i % 10


class ApexStylePrefetcher:
    """apex's ``data_prefetcher`` algorithm, its stream made once: one batch ahead, float and
    normalize on the side stream, ``wait_stream`` and ``record_stream`` when handing over."""

    def __init__(self, loader: Iterable[Any], device: torch.device) -> None:
        self.loader = loader
        self.stream = torch.cuda.Stream(device=device)
        self.device = device
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def _preload(self, it: Iterator[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        try:
            x, y = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            x = x.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
            y = y.to(self.device, non_blocking=True)
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        it = iter(self.loader)
        ahead = self._preload(it)
        while ahead is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            x, y = ahead
            x.record_stream(torch.cuda.current_stream())
            y.record_stream(torch.cuda.current_stream())
            ahead = self._preload(it)
            yield x, y


class TimmStylePrefetcher:
    """timm's ``PrefetchLoader`` algorithm as of timm 1.0.31: one stream for the loader's life;
    before each batch's copy the side stream waits for the consumer's stream, after it the
    consumer's stream waits for the side stream; no ``record_stream``."""

    def __init__(self, loader: Iterable[Any], device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        consumer = torch.cuda.current_stream(self.device)
        current: tuple[torch.Tensor, torch.Tensor] | None = None
        for x, y in self.loader:
            self.stream.wait_stream(consumer)
            with torch.cuda.stream(self.stream):
                nx = x.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
                ny = y.to(self.device, non_blocking=True)
            if current is not None:
                yield current
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(self.stream)
            current = (nx, ny)
        if current is not None:
            yield current


@dataclass
class StepResult:
    """End-to-end epoch time of one arm (the median), its ratio to the data-on-GPU bound, and
    every round's epoch (rounds in the order run, to pair arms round by round)."""

    arm: str
    epoch_s: float
    vs_bound: float
    rounds_s: tuple[float, ...] = ()


def _model(device: torch.device, channels: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
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


def measure_step(
    batches: int = 24,
    batch_size: int = 64,
    rounds: int = 5,
    channels: int = 64,
    num_workers: int = 4,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[StepResult]:
    """A small conv net trained on uint8 3x224x224 batches, fed five ways from the same workers.

    plain (``.to`` and normalize in the loop), apex-style and timm-style prefetchers all iterate
    one ``DataLoader`` with ``num_workers`` persistent workers and ``pin_memory=True``;
    DataLoaderX has the same workers (it pins in its thread); the bound iterates batches already
    normalized on the GPU. ``variants``: more DataLoaderX arms, by name, with these keyword
    arguments besides the others'.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(device, channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    dataset = _Images(batches * batch_size)
    workers: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,
    }

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    plain_loader = DataLoader(dataset, pin_memory=True, **workers)
    ours = {
        name: DataLoaderX(dataset, device=device, mean=MEAN, std=STD, **workers, **kwargs)
        for name, kwargs in {"prefetchx": {}, **(variants or {})}.items()
    }
    apex_style = ApexStylePrefetcher(plain_loader, device)
    timm_style = TimmStylePrefetcher(plain_loader, device)
    on_gpu = [((x.to(device).float() - mean) / std, y.to(device)) for x, y in plain_loader]

    def plain() -> None:
        for x, y in plain_loader:
            step(
                (x.to(device, non_blocking=True).float() - mean) / std,
                y.to(device, non_blocking=True),
            )

    def over(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            for x, y in batches:
                step(x, y)

        return run

    arms = {
        "plain": plain,
        "apex-style": over(apex_style),
        "timm-style": over(timm_style),
        **{name: over(loader) for name, loader in ours.items()},
        "data-on-gpu": over(on_gpu),
    }
    for fn in arms.values():
        fn()  # warm-up: workers started, allocator pools filled
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            torch.cuda.synchronize()
            times[name].append(_events_time(arms[name]))
    for loader in ours.values():
        loader.close()
    bound_s = statistics.median(times["data-on-gpu"])
    return [
        StepResult(name, statistics.median(t), statistics.median(t) / bound_s, tuple(t))
        for name, t in times.items()
    ]


@dataclass
class MeterResult:
    """The GPU stall meter: its cost per batch, and its idle time against a check without it.

    ``cost_us``: host time of a batch's two timing events and their reading, per batch.
    With a producer delay injected per batch, the epoch grows by the time the GPU waited; the
    meter should report about the same growth in ``gpu_idle``: ``idle_growth_ms`` against
    ``epoch_growth_ms``, per batch, each the median over ``rounds`` paired epochs (one with the
    delay, one without, back to back in alternating order).
    """

    cost_us: float
    delay_ms: float
    epoch_growth_ms: float
    idle_growth_ms: float
    rounds: int = 1


def measure_meter(
    batches: int = 32, batch_size: int = 16, delay_ms: float = 5.0, rounds: int = 7
) -> MeterResult:
    """The meter's per-batch cost, and whether its idle time matches an injected delay.

    One epoch with the delay against one without read 4.08 ms of growth a batch against the
    meter's 6.18 ms on an H200 at 46e88dd, where 1abc908's run read 6.25 and 6.31: a single
    unpaired epoch cannot tell the meter's error from the epoch's noise. So each of ``rounds``
    rounds times both loaders, in alternating order, and the figures are the medians of the
    rounds' differences.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(device)
    consumer = streams.consumer()
    n = 10_000
    start = time.perf_counter()
    for _ in range(n):
        asked = streams.mark(consumer, timing=True)
        handed = streams.mark(consumer, timing=True)
        if streams.done(handed):
            streams.elapsed_s(asked, handed)
    cost_us = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()

    model = _model(device, 32)
    per_item = delay_ms / 1e3 / batch_size
    loaders: dict[float, DataLoaderX[Any]] = {}
    for delay in (0.0, per_item):
        images = _Images(batches * batch_size, delay)
        loaders[delay] = DataLoaderX(
            images, batch_size=batch_size, device=device, mean=MEAN, std=STD
        )
    epochs = {delay: _training(model, loader) for delay, loader in loaders.items()}
    for epoch in epochs.values():
        epoch()  # warm-up

    def timed(delay: float) -> tuple[float, float]:
        epoch_s = _events_time(epochs[delay])
        torch.cuda.synchronize()  # the meter reads completed events only
        return epoch_s, loaders[delay].stats.gpu_idle.total

    growth, idle = [], []
    for r in range(rounds):
        order = (0.0, per_item) if r % 2 == 0 else (per_item, 0.0)
        got = {delay: timed(delay) for delay in order}
        (base_epoch, base_idle), (slow_epoch, slow_idle) = got[0.0], got[per_item]
        growth.append((slow_epoch - base_epoch) / batches * 1e3)
        idle.append((slow_idle - base_idle) / (batches - 1) * 1e3)
    return MeterResult(
        cost_us, delay_ms, statistics.median(growth), statistics.median(idle), rounds
    )


def _training(model: torch.nn.Module, loader: Iterable[Any]) -> Callable[[], None]:
    def epoch() -> None:
        with torch.no_grad():
            for x, _ in loader:
                model(x)

    return epoch
