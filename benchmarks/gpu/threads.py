"""#15 run 7: the main thread's torch thread count before, during and after an epoch.

    python benchmarks/gpu/threads.py

For plain DataLoader and DataLoaderX (CPU only, and with ``device`` set to the accelerator where
there is one), with 0 and 4 workers: ``torch.get_num_threads()`` and
``torch.get_num_interop_threads()`` in the main thread before the first epoch, at the first batch
and after the epoch. DataLoader is the specification: DataLoaderX's three figures must equal plain
DataLoader's in each configuration. Exits 1 where they differ.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX
from prefetchx.bench.cuda import MEAN, STD, _Images


def counts() -> tuple[int, int]:
    return torch.get_num_threads(), torch.get_num_interop_threads()


def epoch(make: type[DataLoader], workers: int, **extra: object) -> list[tuple[int, int]]:
    loader = make(_Images(8 * 16), batch_size=16, num_workers=workers, **extra)
    seen = [counts()]
    for i, (x, _y) in enumerate(loader):
        if i == 0:
            seen.append(counts())
        x.float().sum()  # an op that uses the intra-op pool, as a step would
    seen.append(counts())
    return seen


def main() -> int:
    print(f"usable CPUs {len(os.sched_getaffinity(0))}, torch threads at start {counts()}")
    arms: list[tuple[str, dict[str, object]]] = [("cpu", {})]
    if torch.cuda.is_available():
        arms.append(("cuda", {"device": "cuda", "mean": MEAN, "std": STD}))
    failed = 0
    print("arm, workers: (intra-op, inter-op) before / at the first batch / after")
    for name, extra in arms:
        for workers in (0, 4):
            plain = epoch(DataLoader, workers)
            ours = epoch(DataLoaderX, workers, **extra)
            same = plain == ours
            failed += not same
            print(f"{name}, {workers}: DataLoader {plain}  DataLoaderX {ours}  same: {same}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
