"""prefetchx: a drop-in PyTorch DataLoader that stops training from waiting for data."""

from __future__ import annotations

from prefetchx import _accelerate  # noqa: F401  # registers accelerate's hooks; imports no accelerate
from prefetchx._collate import fast_collate
from prefetchx._loader import DataLoaderX
from prefetchx._prefetcher import Prefetcher
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import ThreadStage

__all__ = ["DataLoaderX", "EpochStats", "Prefetcher", "ThreadStage", "fast_collate"]

__version__ = "0.1.0.dev0"
