"""A realistic CPU workload: JPEG decoding in the dataset, a small conv net step on the CPU."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from prefetchx._collate import fast_collate
from prefetchx._loader import DataLoaderX

MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def make_jpegs(folder: Path, n: int, size: int = 224) -> list[Path]:
    """Write ``n`` photo-like JPEGs (smooth gradients with noise) of ``size`` x ``size``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size)
    paths = []
    for i in range(n):
        base = ramp[None, :, None] * rng.uniform(0.3, 1.0, 3) + ramp[:, None, None] * 0.3
        noise = rng.normal(0, 20, (size, size, 3))
        pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


class JpegDataset(Dataset[tuple[np.ndarray, int]]):
    """Decodes one JPEG per item into an ``H, W, 3`` uint8 array, with a label."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        from PIL import Image

        with Image.open(self.paths[i]) as image:
            return np.asarray(image.convert("RGB")), i % 10


def small_convnet() -> torch.nn.Module:
    """A few conv layers, enough for a step of tens of milliseconds on two cores."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )


@dataclass
class JpegResult:
    """Epoch times of the plain and prefetchx arms at one worker count."""

    num_workers: int
    batches: int
    plain_s: float
    prefetchx_s: float
    speedup: float
    verdict: str


def measure_jpeg(
    num_workers: int,
    images: int = 128,
    batch_size: int = 16,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> JpegResult:
    """Plain DataLoader, normalizing in the loop, against DataLoaderX normalizing in its thread."""
    torch.manual_seed(0)
    model = small_convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    with tempfile.TemporaryDirectory(prefix="prefetchx-bench-") as folder:
        dataset = JpegDataset(make_jpegs(Path(folder), images))
        common: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": fast_collate,
            "num_workers": num_workers,
        }
        plain = DataLoader(dataset, **common)
        ours: DataLoaderX[Any] = DataLoaderX(dataset, device="cpu", mean=MEAN, std=STD, **common)

        def plain_epoch() -> None:
            for x, y in plain:
                train_step((x.float() - mean) / std, y)

        def ours_epoch() -> None:
            for x, y in ours:
                train_step(x, y)

        arms = {"plain": plain_epoch, "prefetchx": ours_epoch}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(rounds):
            for name in list(arms)[r % 2 :] + list(arms)[: r % 2]:
                start = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - start)
            if progress is not None:
                progress(f"  jpeg num_workers={num_workers}: round {r + 1}/{rounds}")
        plain_s = statistics.median(times["plain"])
        ours_s = statistics.median(times["prefetchx"])
        return JpegResult(
            num_workers, len(plain), plain_s, ours_s, plain_s / ours_s, ours.stats.verdict()
        )
