"""Shared fixtures: every test must leave no prefetchx thread and no worker process behind, and
only `cuda`-marked tests see an accelerator."""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

collect_ignore = [] if importlib.util.find_spec("accelerate") else ["prefetchx/accelerate.py"]
"""prefetchx.accelerate imports accelerate, an optional dependency: without it, nothing to test."""

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


@pytest.fixture(autouse=True)
def no_accelerator_unless_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside `cuda`-marked tests, this machine looks like one without an accelerator.

    ``device=None`` picks the accelerator when there is one, so on a GPU machine the CPU tests
    would otherwise move their batches to the GPU. They describe the CPU path and must run as
    they do in CI; the GPU path is the `cuda`-marked tests'. Child processes get no visible
    CUDA device either (``CUDA_VISIBLE_DEVICES`` is restored after the test). A test that fakes
    an accelerator patches these again, and its patches win.
    """
    if request.node.get_closest_marker("cuda") is not None:
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        monkeypatch.setattr(accelerator, "is_available", lambda: False)
        monkeypatch.setattr(accelerator, "device_count", lambda: 0)
        monkeypatch.setattr(accelerator, "current_accelerator", lambda *args, **kwargs: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def thread_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside `adaptive`-marked tests, the thread stage runs its thread from the second item on.

    By default a loader parks its thread where measuring shows the loop faster without it, so a
    test whose loop does no work would soon run without it, and a test of what the thread does
    could pass without testing it. The tests of the decision itself are marked `adaptive`; a
    test that switches on purpose patches the decision again, and its patch wins.
    """
    if request.node.get_closest_marker("adaptive") is not None:
        return
    from tests.helpers import AlwaysThreaded

    monkeypatch.setattr("prefetchx._pipeline.Decision", AlwaysThreaded)


@pytest.fixture(params=["threaded", "switching"])
def both_modes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: with the thread on (as `thread_mode` has it), and with the loader
    handing the source between the thread and the caller at every window of one item, the
    hand-over at about its most frequent."""
    if request.param == "switching":
        from tests.helpers import Switching

        monkeypatch.setattr("prefetchx._pipeline.Decision", Switching)
    return str(request.param)


WORKERS = 2
"""Processes that plain `pytest` runs the suite in, where pytest-xdist is installed (the `dev`
extra) and the machine has that many cores: CI's 2-core machine is the one the suite, its
timing bounds included, is checked on."""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Plain `pytest` runs in `WORKERS` processes; ``-n`` chooses otherwise (``-n 0``: one),
    as do ``-p no:xdist``, ``--pdb`` and a run without pytest-xdist.

    Many tests wait: on a child interpreter importing torch (4 s on the 2-core VM), on worker
    processes, on timeouts. In one process the suite kept one of the VM's two cores busy
    and took 446 s; in two, 280 s.
    """
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option = config.option
    if option.numprocesses is not None or option.dist != "no" or option.usepdb:
        return
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere, the machine's count
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    if option.collectonly or cores < WORKERS:
        return
    option.numprocesses = WORKERS


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection imported out of every later garbage collection.

    `no_leaks` collects garbage after each test, so that an iterator a test dropped ends its
    thread, and some tests collect on purpose. With torch, the test modules and the optional
    integrations imported, a full collection walks about 460,000 objects that live for the
    whole run: 0.3 s on the 2-core VM, paid after each of about a thousand tests (330 s of a
    798 s run went to teardowns). Frozen, a collection walks only what the tests made since.
    """
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda`-marked tests cleanly where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
