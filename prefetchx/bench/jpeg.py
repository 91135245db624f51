"""A realistic CPU workload: JPEG decoding with a crop and a flip in the dataset, a small conv
net step on the CPU.

Every arm gets the same DataLoader arguments, its collate function included: `fast_collate`, then
the normalization DataLoaderX itself runs for ``mean``/``std`` (`Normalize`). So every arm
normalizes in the same place, its DataLoader's collate (in a worker, or without workers where the
batch is made), and the arms differ only in how batches reach the loop. Workers are persistent
and each arm runs one untimed epoch before the rounds, so the rounds time steady epochs, not
worker start-up. Arms run in paired rounds (`prefetchx.bench.paired`).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from prefetchx._collate import fast_collate
from prefetchx._normalize import Normalize
from prefetchx.bench.paired import MIN_ROUNDS, Spread, ratios, run_rounds
from prefetchx.bench.synthetic import ARMS, release

MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)

SIZE = 256
"""Side of the JPEG files, in pixels."""

CROP = 224
"""Side of the crop the dataset cuts from each image."""


def make_jpegs(folder: Path, n: int, size: int = SIZE) -> list[Path]:
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


@contextlib.contextmanager
def jpeg_files(n: int, size: int = SIZE) -> Iterator[list[Path]]:
    """``n`` JPEGs (`make_jpegs`) in a temporary folder, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="prefetchx-bench-") as folder:
        yield make_jpegs(Path(folder), n, size)


class JpegDataset(Dataset[tuple[np.ndarray, int]]):
    """Decodes one JPEG per item, cuts a ``crop`` x ``crop`` square from it and flips every
    other one, as a training pipeline's random crop and flip would (the positions come from the
    index, so every arm gets the same pixels); an ``H, W, 3`` uint8 array with a label."""

    def __init__(self, paths: list[Path], crop: int = CROP) -> None:
        self.paths = paths
        self.crop = crop

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        from PIL import Image

        with Image.open(self.paths[i]) as image:
            rgb = image.convert("RGB")
        width, height = rgb.size
        crop = min(self.crop, width, height)
        left = i * 37 % (width - crop + 1)
        top = i * 53 % (height - crop + 1)
        rgb = rgb.crop((left, top, left + crop, top + crop))
        if i % 2:
            rgb = rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(rgb), i % 10


class NormalizingCollate:
    """`fast_collate`, then DataLoaderX's own normalization to float32: one collate function
    for every arm, so every arm does the float work in the same place."""

    def __init__(self) -> None:
        self.normalize = Normalize(MEAN, STD)

    def __call__(self, samples: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = fast_collate(samples)
        return self.normalize(images), labels


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
    """The arms' epoch times at one thread and worker count, and their speed over plain.

    ``ratios`` holds, per arm, the plain arm's epoch time over the arm's, round by round, as a
    spread (``median``, ``low``, ``high``, ``rounds``); ``speedup`` is DataLoaderX's median.
    ``verdict`` is DataLoaderX's stall meter over its last epoch.
    """

    torch_threads: int
    num_workers: int
    batches: int
    rounds: int
    epochs_s: dict[str, list[float]]
    ratios: dict[str, dict[str, Any]]
    speedup: float
    verdict: str

    def spread(self, arm: str) -> Spread:
        """``arm``'s speed over plain as a `Spread`."""
        return Spread(**self.ratios[arm])

    @property
    def label(self) -> str:
        """A short name, as the conclusion and the plot give it."""
        threads = "thread" if self.torch_threads == 1 else "threads"
        workers = "worker" if self.num_workers == 1 else "workers"
        return f"JPEG, {self.torch_threads} torch {threads}, {self.num_workers} {workers}"


def _epoch(loader: Iterable[Any], step: Callable[[Any, Any], None]) -> float:
    start = time.perf_counter()
    for x, y in loader:
        step(x, y)
    return time.perf_counter() - start


def measure_jpeg(
    num_workers: int,
    *,
    torch_threads: int | None = None,
    images: int = 256,
    batch_size: int = 16,
    rounds: int = MIN_ROUNDS,
    arms: Sequence[str] = ("plain", "recipe", "prefetchx"),
    max_prefetch: int = 2,
    paths: list[Path] | None = None,
    progress: Callable[[str], None] | None = None,
) -> JpegResult:
    """Time ``arms`` on the JPEG workload in paired rounds, after one untimed epoch each.

    Args:
        num_workers: DataLoader workers, persistent when there are any.
        torch_threads: torch's intra-op threads for the step (restored afterwards); ``None``
            keeps the current count.
        images: Images per epoch (written to a temporary folder unless ``paths`` are given).
        batch_size: Images per batch.
        rounds: Paired rounds.
        arms: Arms of `prefetchx.bench.synthetic.ARMS`; ``plain`` is needed, the baseline.
        max_prefetch: Queue depth of the arms that prefetch.
        paths: JPEG files to read (from `jpeg_files`), instead of writing ``images`` of them.
        progress: Called with a line after each round.
    """
    if "plain" not in arms:
        raise ValueError(f"`arms` must include 'plain', the baseline, got {tuple(arms)}.")
    threads = torch.get_num_threads() if torch_threads is None else torch_threads
    previous = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        if paths is None:
            paths = stack.enter_context(jpeg_files(images))
        torch.set_num_threads(threads)
        stack.callback(torch.set_num_threads, previous)
        torch.manual_seed(0)
        model = small_convnet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        dataset = JpegDataset(paths[:images])
        common: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": NormalizingCollate(),
            "num_workers": num_workers,
            "persistent_workers": num_workers > 0,
        }
        loaders = {name: ARMS[name](dataset, max_prefetch, common) for name in arms}
        for loader in loaders.values():
            stack.callback(release, loader)
        for loader in loaders.values():
            _epoch(loader, train_step)  # workers started, caches and allocator warm

        def report(done: int) -> None:
            if progress is not None:
                progress(
                    f"  jpeg, {threads} torch threads, {num_workers} workers: round {done}/{rounds}"
                )

        epochs = {
            name: functools.partial(_epoch, loader, train_step) for name, loader in loaders.items()
        }
        times = run_rounds(epochs, rounds, report)
        spreads = ratios(times)
        ours = loaders.get("prefetchx")
        stats = getattr(ours, "stats", None)
        return JpegResult(
            torch_threads=threads,
            num_workers=num_workers,
            batches=-(-len(dataset) // batch_size),
            rounds=rounds,
            epochs_s=times,
            ratios={name: asdict(spread) for name, spread in spreads.items()},
            speedup=spreads["prefetchx"].median if "prefetchx" in spreads else float("nan"),
            verdict=stats.verdict() if stats is not None else "",
        )
