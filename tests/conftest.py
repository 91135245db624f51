"""Shared fixtures: every test must leave no prefetchx thread and no worker process behind."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

LEAK_WAIT = 15.0
"""Seconds a test's threads and workers get to end after it returns (a worker that is busy with a
batch finishes it first); far above the usual few milliseconds."""


def _prefetchx_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]


def _worker_processes(before: set[int]) -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in before:
            continue
        try:
            cmdline = " ".join(child.cmdline())
            if "forkserver" in cmdline or "resource_tracker" in cmdline:
                continue  # multiprocessing's own helpers, shared by all tests
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        alive.append(child)
    return alive


def leftovers(before: set[int], wait: float = LEAK_WAIT) -> tuple[list[str], list[int]]:
    """The ``prefetchx-*`` threads and the worker processes (not in ``before``) still running
    after up to ``wait`` seconds; empty lists when all have ended."""
    deadline = time.monotonic() + wait
    while True:
        gc.collect()
        threads = _prefetchx_threads()
        workers = _worker_processes(before)
        if (not threads and not workers) or time.monotonic() > deadline:
            return [t.name for t in threads], [w.pid for w in workers]
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a ``prefetchx-*`` thread or a worker process running."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    threads, workers = leftovers(before)
    if threads or workers:
        pytest.fail(f"test leaked threads {threads} and worker processes {workers}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda`-marked tests cleanly where no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
