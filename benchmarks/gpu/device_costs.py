"""Where the device stage's host time goes on small batches: each part switched off in turn.

    python benchmarks/gpu/device_costs.py

2000 batches of 32x16 float32 from a TensorDataset, no step (the batches are made in the loop's
thread: the thread would hide nothing), arms interleaved over 7 rounds, medians and the spread.
Every arm but the first two is DataLoaderX to CUDA with one part of its per-batch work replaced
by nothing. Some of those arms are unsafe (a copy may race the caller's work or the memory's
reuse) and exist only to price that part; each arm's cost is its median minus the full stage's.
GPU only.
"""

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, TensorDataset

from prefetchx import DataLoaderX
from prefetchx._device import CudaStreams
from prefetchx._device_stage import Copying

N, B, ROUNDS = 64000, 32, 7
ds = TensorDataset(torch.randn(N, 16), torch.arange(N))
dev = torch.device("cuda")


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def on_consumer(self: CudaStreams, consumer: object) -> Iterator[None]:
    yield


def no_meter(loader: DataLoaderX) -> Iterator[object]:
    it = iter(loader)
    it._stage._idle = None  # type: ignore[attr-defined]
    return it


def epoch(
    make: Callable[[], object], to: bool = False, wrap: Callable[[object], Iterator[object]] = iter
) -> Callable[[], float]:
    loader = make()

    def run() -> float:
        t = time.perf_counter()
        for x, y in wrap(loader):
            if to:
                x = x.to(dev, non_blocking=True)
                y = y.to(dev, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    return run


def X() -> DataLoaderX:
    return DataLoaderX(ds, batch_size=B)


nothing = contextlib.nullcontext
arms: dict[str, tuple[Callable[[], float], Callable[[], contextlib.AbstractContextManager]]] = {
    "plain pin+.to": (epoch(lambda: DataLoader(ds, batch_size=B, pin_memory=True), True), nothing),
    "X cuda": (epoch(X), nothing),
    "- gpu meter": (epoch(X, wrap=no_meter), nothing),
    "- fence before": (epoch(X), lambda: patched(CudaStreams, "side_waits_for", lambda s, c: None)),
    "- side stream": (epoch(X), lambda: patched(CudaStreams, "on_side", on_consumer)),
    "- record_stream": (epoch(X), lambda: patched(CudaStreams, "protect", lambda s, t, c: None)),
    "- host keeping": (epoch(X), lambda: patched(Copying, "add", lambda s, h, e: None)),
}
for run, context in arms.values():
    with context():
        run()
times: dict[str, list[float]] = {name: [] for name in arms}
names = list(arms)
for r in range(ROUNDS):
    for name in names[r % len(names) :] + names[: r % len(names)]:
        run, context = arms[name]
        with context():
            times[name].append(run())
nb = N // B
full = statistics.median(times["X cuda"]) / nb * 1e6
print(f"{nb} batches of {B}x16 float32, no step, {ROUNDS} rounds, us per batch:")
print(f"{'arm':>16} {'median':>8} {'min-max':>15} {'vs X cuda':>10}")
for name, t in times.items():
    med, low, high = (v / nb * 1e6 for v in (statistics.median(t), min(t), max(t)))
    print(f"{name:>16} {med:8.1f} {low:7.1f}-{high:<7.1f} {med - full:+10.1f}")
