"""Where a small batch's time goes on a GPU: DataLoaderX against plain + .to() in the loop.

    python benchmarks/gpu/small_batches.py

2000 batches of 32x16 float32 from a TensorDataset, no step, arms interleaved over 5 rounds
(medians); then a cProfile of DataLoaderX's epoch, and torch's intra-op thread count before and
after an epoch with 2 workers (#15 run 7). GPU only.
"""

import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from prefetchx import DataLoaderX

N, B = 64000, 32
ds = TensorDataset(torch.randn(N, 16), torch.arange(N))
dev = torch.device("cuda")


def plain_cpu():
    return DataLoader(ds, batch_size=B)


def epoch(loader, to=False):
    t = time.perf_counter()
    for x, y in loader:
        if to:
            x = x.to(dev, non_blocking=True)
            y = y.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


arms = {
    "plain (cpu)": (lambda: DataLoader(ds, batch_size=B), False),
    "plain+.to": (lambda: DataLoader(ds, batch_size=B), True),
    "plain pin+.to": (lambda: DataLoader(ds, batch_size=B, pin_memory=True), True),
    "X cpu": (lambda: DataLoaderX(ds, batch_size=B, device="cpu"), False),
    "X cuda": (lambda: DataLoaderX(ds, batch_size=B), False),
    "X cuda mp0": (lambda: DataLoaderX(ds, batch_size=B, max_prefetch=0), False),
    "X cuda dp0": (lambda: DataLoaderX(ds, batch_size=B, device_prefetch=0), False),
    "X cuda dp2": (lambda: DataLoaderX(ds, batch_size=B, device_prefetch=2), False),
}
loaders = {k: (make(), to) for k, (make, to) in arms.items()}
for loader, to in loaders.values():
    epoch(loader, to)
times = {k: [] for k in loaders}
names = list(loaders)
for r in range(5):
    for k in names[r % len(names) :] + names[: r % len(names)]:
        loader, to = loaders[k]
        times[k].append(epoch(loader, to))
nb = N // B
print(f"{nb} batches of {B}x16 float32, 5 rounds, us per batch (median, min-max):")
for k, t in times.items():
    med, low, high = (v / nb * 1e6 for v in (statistics.median(t), min(t), max(t)))
    print(f"  {k:>14}: {med:7.1f} ({low:.1f}-{high:.1f})")
loader_x, _ = loaders["X cuda"]
print("\nstats of X cuda:", loader_x.stats.verdict())
pr = cProfile.Profile()
pr.enable()
epoch(loader_x)
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
print("threads before/after epoch:", end=" ")
before = torch.get_num_threads()
epoch(DataLoaderX(ds, batch_size=B, num_workers=2))
print(before, torch.get_num_threads())
