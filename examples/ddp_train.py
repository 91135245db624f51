"""Train a small conv net with DistributedDataParallel, fed by DataLoaderX.

Run one process per GPU (NCCL), or two processes on the CPU (gloo) where there is no GPU:

    torchrun --nproc_per_node=2 examples/ddp_train.py --epochs 2

Each rank reads its share of a synthetic uint8 image dataset through a `DistributedSampler`.
DataLoaderX copies the next batch to the rank's own GPU on a side stream and normalizes it there;
on the CPU it normalizes in its background thread. Each rank prints one line at the end: where its
batches landed, its steps and samples, its last loss and the stall meter's verdict.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from prefetchx import DataLoaderX

MEAN = (123.675, 116.28, 103.53)  # ImageNet statistics in 0-255 units, as the images come
STD = (58.395, 57.12, 57.375)
CLASSES = 10


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """``size`` uint8 3x32x32 images; each image and its label depend only on its index."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=generator)
        return image, index % CLASSES


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512, help="dataset size, all ranks")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--max-prefetch", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even with GPUs")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        parser.error("launch it with torchrun, e.g. torchrun --nproc_per_node=2 " + sys.argv[0])
    return args


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and not args.cpu:
        # Before anything touches CUDA, or this rank opens a context on GPU 0 as well.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, CLASSES),
    ).to(device, memory_format=torch.channels_last)
    model = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    dataset = SyntheticImages(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoaderX(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=True,  # every batch the same shape (torch.compile would compile the last again)
        max_prefetch=args.max_prefetch,
        # The rank's own device, named: the producer thread and the side stream use it.
        device=device,
        mean=MEAN,
        std=STD,
        channels_last=True,
    )
    steps = samples = 0
    loss = torch.zeros(())
    landed: set[str] = set()
    with loader:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            for images, labels in loader:
                landed.add(str(images.device))
                optimizer.zero_grad(set_to_none=True)
                # Every tensor of the batch is on `device` already, labels too.
                loss = nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                steps += 1
                samples += len(labels)
    # One write per line: the ranks share the terminal.
    sys.stdout.write(
        f"rank {rank}/{world_size} device={','.join(sorted(landed))} epochs={args.epochs} "
        f"steps={steps} samples={samples} loss={loss.item():.4f} | {loader.stats.verdict()}\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
