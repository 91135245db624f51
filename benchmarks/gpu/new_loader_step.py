"""A new loader's first epoch in the end-to-end GPU step: DataLoaderX against apex-style and
timm-style prefetchers, each built anew every round and timed from before it is made.

    PYTHONPATH=<package to measure> python benchmarks/gpu/new_loader_step.py [--rounds N]

The bench's end-to-end step (`prefetchx.bench.cuda.measure_step`) times warmed loaders with
persistent workers. A user meets a new loader first: a new process, an evaluation loader built
anew, a short fine-tune. Here every arm, in every round, is a new DataLoader (workers not
persistent) wrapped as the arm wraps it, and its time runs from before it is made to the end of
its first epoch on the GPU: the workers' start, the first batch, every step. The model, the
dataset and the CUDA context are made once, before the rounds. Arms run once a round in a
rotated order; each figure is the median, over the rounds, of the arm's epoch over
apex-style's in the same round, with the lowest and highest round. GPU only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX
from prefetchx.bench.cuda import (
    MEAN,
    STD,
    ApexStylePrefetcher,
    TimmStylePrefetcher,
    _Images,
    _model,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(device, args.channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    dataset = _Images(args.batches * args.batch_size)
    shape: dict[str, Any] = {"batch_size": args.batch_size, "num_workers": args.workers}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    def plain() -> Iterable[Any]:
        for x, y in DataLoader(dataset, pin_memory=True, **shape):
            yield ((x.to(device, non_blocking=True).float() - mean) / std, y.to(device))

    arms: dict[str, Callable[[], Iterable[Any]]] = {
        "plain": plain,
        "apex-style": lambda: ApexStylePrefetcher(
            DataLoader(dataset, pin_memory=True, **shape), device
        ),
        "timm-style": lambda: TimmStylePrefetcher(
            DataLoader(dataset, pin_memory=True, **shape), device
        ),
        "prefetchx": lambda: DataLoaderX(dataset, device=device, mean=MEAN, std=STD, **shape),
    }

    def first_epoch(make: Callable[[], Iterable[Any]]) -> float:
        # Workers fork from a process whose CUDA is initialized; a forked worker that frees a
        # CUDA tensor (cyclic garbage it inherited, collected there) aborts. Collected here
        # first, untimed.
        gc.collect()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for x, y in make():
            step(x, y)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for make in arms.values():  # once untimed: the CUDA context, kernels, allocator pools
        first_epoch(make)
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(first_epoch(arms[name]))
    print(
        f"== new loaders' first epochs: {args.batches} batches of {args.batch_size}, "
        f"{args.workers} workers (not persistent), channels={args.channels}, {args.rounds} rounds"
    )
    print(f"{'arm':>12} {'epoch ms':>9}  {'/ apex-style, paired':>22}")
    for name in names:
        vs = [a / b for a, b in zip(times[name], times["apex-style"], strict=True)]
        print(
            f"{name:>12} {statistics.median(times[name]) * 1e3:9.1f}  "
            f"{statistics.median(vs):6.3f} ({min(vs):.3f}-{max(vs):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
