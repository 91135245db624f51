"""Datasets and helpers the tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from prefetchx._choose import Decision, Window
from prefetchx._device_stage import DeviceStage
from prefetchx._producer import Producer

T = TypeVar("T")

RECORDS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "results")
needs_records = pytest.mark.skipif(
    not os.path.isdir(RECORDS),
    reason="the benchmark records live in the repository, not in the source distribution",
)
"""For tests that read a recorded run under ``benchmarks/results/``."""


class Squares(Dataset[torch.Tensor]):
    """``n`` items; item ``i`` is ``[i, i*i]``. Optionally fails at one index or sleeps."""

    def __init__(
        self,
        n: int,
        *,
        fail_at: int | None = None,
        error: BaseException | None = None,
        delay: float = 0.0,
    ) -> None:
        self.n = n
        self.fail_at = fail_at
        self.error = error if error is not None else ValueError(f"boom at index {fail_at}")
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        if i == self.fail_at:
            # A new exception each time, as real code raises them: one instance kept by the
            # dataset would keep its traceback, and the iterator's frames in it, alive.
            raise type(self.error)(*self.error.args)
        return torch.tensor([i, i * i])


class SlowAfterFirst(Squares):
    """Item 0 at once, every later item after ``seconds``: the thread waits inside next()."""

    def __init__(self, n: int, seconds: float) -> None:
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i: int) -> torch.Tensor:
        if i > 0:
            time.sleep(self.seconds)
        return super().__getitem__(i)


class Counting(Dataset[int]):
    """Counts the items produced, so a test can see how far ahead the loader runs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.produced = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.produced += 1
        return i


class Gated(Dataset[int]):
    """Item ``block_at`` waits for ``gate`` before it is returned (num_workers=0 only)."""

    def __init__(self, n: int, block_at: int) -> None:
        self.n = n
        self.block_at = block_at
        self.gate = threading.Event()
        self.reached = threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.block_at:
            self.reached.set()
            self.gate.wait(30)
        return i


class Stream(IterableDataset[int]):
    """An iterable dataset of ``range(n)``, sharded across workers, that remembers its threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iter_threads: list[str] = []

    def __iter__(self) -> Iterator[int]:
        self.iter_threads.append(threading.current_thread().name)
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class DrawFails:
    """An iterator over ``range(n)`` whose ``fail_at``-th draw (from 1) raises, and which goes
    on after it, as an iterator that is not a generator may."""

    def __init__(self, n: int, fail_at: int) -> None:
        self.drawn, self.n, self.fail_at = 0, n, fail_at

    def __iter__(self) -> DrawFails:
        return self

    def __next__(self) -> int:
        self.drawn += 1
        if self.drawn > self.n:
            raise StopIteration
        if self.drawn == self.fail_at:
            raise IndexError(f"no index at draw {self.drawn}")
        return self.drawn - 1


class FailingSampler(Sampler[int]):
    """A sampler over ``range(n)`` whose iterator's ``fail_at``-th draw raises; see `DrawFails`."""

    def __init__(self, n: int, fail_at: int) -> None:
        self.n, self.fail_at = n, fail_at

    def __iter__(self) -> Iterator[int]:
        return DrawFails(self.n, self.fail_at)

    def __len__(self) -> int:
        return self.n


def outcomes(iterator: Iterator[Any], limit: int = 10**6) -> list[Any]:
    """Every outcome of ``next()`` until StopIteration (at most ``limit``): batches as plain
    values, errors as ``"Type: message"``, each with the messages of the warnings shown during
    that call; warning filters stay the same throughout."""
    out: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(limit):
            seen = len(caught)
            try:
                value: Any = plain(next(iterator))
            except StopIteration:
                break
            except Exception as exc:
                value = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                # DataLoader's re-raise of a worker's error leaves a reference cycle through its
                # frames, which keeps the iterator until a gc pass; its workers then take 5 s
                # each to shut down (their queues are finalized first). Break it, for both.
                traceback.clear_frames(exc.__traceback__)
            out.append((value, [str(w.message) for w in caught[seen:]]))
    return out


def plain(value: Any) -> Any:
    """A batch as plain Python values: tensors as lists, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def both(run: Callable[[type[DataLoader[Any]]], T], seed: int = 0) -> tuple[T, T]:
    """``run(DataLoader)`` and ``run(DataLoaderX)``, each after ``torch.manual_seed(seed)``."""
    from prefetchx import DataLoaderX

    results = []
    for cls in (DataLoader, DataLoaderX):
        torch.manual_seed(seed)
        results.append(run(cls))
    return results[0], results[1]


def as_lists(batches: object) -> list[object]:
    """Batches as plain Python values, for equality checks."""
    out = []
    for batch in batches:  # type: ignore[attr-defined]
        out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
    return out


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds have passed."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def forget_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a fault: the device stage forgets each host batch once its copy is queued, so
    nothing (neither its entry in flight nor `Copying`) holds it until the copy is done."""
    start = DeviceStage._start

    def forgetting(self: DeviceStage, host: Any, consumer: Any) -> tuple[Any, Any, Any]:
        batch, event, _ = start(self, host, consumer)
        return batch, event, None

    monkeypatch.setattr(DeviceStage, "_start", forgetting)


class ThreadGate:
    """Holds every producer thread before each call of its source it would make, until opened
    (`Producer._call` wrapped): meanwhile a thread stage's caller waits for the items."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        call = Producer._call

        def held(producer: Producer, warned: list[Any]) -> Any:
            while not self.open.wait(0.01):
                if producer.stop_event.is_set():
                    break
            return call(producer, warned)

        monkeypatch.setattr(Producer, "_call", held)


def new_children(before: set[int]) -> list[psutil.Process]:
    """This process's children that were not in ``before`` (the pids of an earlier snapshot).

    Other tests may leave multiprocessing's own helpers (a resource tracker) running for the
    rest of the session; a test that counts its workers must not count those.
    """
    return [c for c in psutil.Process().children() if c.pid not in before]


def child_pids() -> set[int]:
    """The pids of this process's children now, for `new_children`."""
    return {c.pid for c in psutil.Process().children()}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, plus ``extra``: the repository first on
    ``PYTHONPATH``, so the child imports this checkout's prefetchx even where another one is
    installed."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_python(
    code: str, env: dict[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in the repository, its output captured as text; ``env`` defaults to
    `repo_env()`."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=repo_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


ALWAYS_THREADED = (
    "import prefetchx._pipeline as _pipeline\n"
    "from tests.helpers import AlwaysThreaded as _AlwaysThreaded\n"
    "_pipeline.Decision = _AlwaysThreaded\n"
)
"""Python source for a child process: its thread stages run their thread from the second item
on, as conftest's ``thread_mode`` makes them in the test process."""


def by_path(path: str, *names: str) -> str:
    """Python source that binds ``names`` from the module file at ``path``, loaded by its path.

    For a child Python that needs a test module's helpers: ``tests`` has no ``__init__.py``, so
    a ``tests`` package that an installed distribution ships wins ``import tests.test_cuda``
    wherever it is on the path; a path cannot be shadowed.
    """
    module = f"_by_path_{os.path.splitext(os.path.basename(path))[0]}"
    return (
        "import importlib.util as _util, sys as _sys\n"
        f"_spec = _util.spec_from_file_location({module!r}, {os.path.abspath(path)!r})\n"
        "_module = _util.module_from_spec(_spec)\n"
        f"_sys.modules[{module!r}] = _module\n"
        "_spec.loader.exec_module(_module)\n"
        + "".join(f"{name} = _module.{name}\n" for name in names)
    )


TORCHRUN_TIMEOUT = 100.0
"""Seconds `torchrun` and its ranks get; a run here takes about 10 s on 2 cores, 30 s on one
busy core with no bytecode cache. Below the 120 s of pytest-timeout, so a hang is reported with
the ranks' output."""

PAUSE_EXCUSE = 30.0
"""Seconds this process may stand still during a failed `torchrun` before the failure is blamed
on the machine and the run made once more (see `Pauses`). A pause stops every process alike, but
a gloo collective times out by the clock: a rank that was waiting in one when the pause began
fails the moment it ends, however healthy the other rank is. A rank that hangs leaves this
process running normally, so a hang is never excused."""


class Pauses:
    """The longest time this process stood still, not scheduled at all, while the block ran.

    A daemon thread wakes every `TICK` seconds; the longest gap between two wake-ups, less the
    tick, is how long the process was not run: on a machine where this idle test process waits
    for children, a paused or starved virtual machine, not code that hangs.
    """

    TICK = 0.1

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tests-pauses", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            stopped = self._stop.wait(self.TICK)
            now = time.monotonic()  # also when stopped: a pause may end just before the stop
            self.longest = max(self.longest, now - last - self.TICK)
            last = now
            if stopped:
                return

    def __enter__(self) -> Pauses:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def torchrun(*args: str, nproc: int = 2, **env: str) -> tuple[int, str, str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=nproc *args`` in the repo.

    Returns the exit status, stdout and stderr; ``env`` is added to the ranks' environment. A run
    past `TORCHRUN_TIMEOUT` is killed with its ranks and their workers, and fails the test with
    what they printed. A run that fails while this process stood still for `PAUSE_EXCUSE`
    seconds or more is made once more; the second attempt's stderr starts with a line saying
    so. A failed run's stderr ends with the longest pause measured during it.
    """
    run = _torchrun_once(args, nproc, env)
    if run.returncode != 0 and run.paused >= PAUSE_EXCUSE:
        first = run
        run = _torchrun_once(args, nproc, env)
        note = (
            f"tests.helpers.torchrun: attempt 1 failed (exit status {first.returncode}) while "
            f"this process stood still for {first.paused:.1f} s, a paused or starved machine: "
            "attempt 2 follows.\n"
        )
        run = run._replace(err=note + run.err)
    pause = f"\ntests.helpers.torchrun: this process stood still for at most {run.paused:.1f} s.\n"
    if run.returncode is None:
        pytest.fail(
            f"torchrun ran past {TORCHRUN_TIMEOUT:g} s:\n{run.out}\n{run.err[-4000:]}{pause}"
        )
    return run.returncode, run.out, run.err if run.returncode == 0 else run.err + pause


class _Run(NamedTuple):
    returncode: int | None
    """``None``: killed at `TORCHRUN_TIMEOUT`."""
    out: str
    err: str
    paused: float
    """The longest time this process stood still during the run (see `Pauses`)."""


def _torchrun_once(args: tuple[str, ...], nproc: int, env: dict[str, str]) -> _Run:
    """One run of torchrun, measured by `Pauses`."""
    # --standalone: the rendezvous binds a free port itself, so no other process can take it.
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    with Pauses() as pauses:
        child = subprocess.Popen(
            [sys.executable, *launcher, *args],
            cwd=REPO,
            env=repo_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # one process group: torchrun, its ranks and their workers
        )
        try:
            out, err = child.communicate(timeout=TORCHRUN_TIMEOUT)
            returncode: int | None = child.returncode
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            returncode = None
    return _Run(returncode, out, err, pauses.longest)


class AlwaysThreaded(Decision):
    """A decision that keeps the thread on from the second item: what most tests run, so that
    they exercise the thread whatever their loop's pace (see conftest's ``thread_mode``)."""

    def window(self, window: Window) -> bool:
        return True


class AlwaysAlone(Decision):
    """A decision that never runs the thread: the loop makes every batch itself."""

    def __init__(self) -> None:
        super().__init__()
        self.threaded = False

    def window(self, window: Window) -> bool:
        return False


class Switching(Decision):
    """A decision that switches between the thread and the caller at every window it is given,
    with windows of one item (conftest's ``both_modes`` shortens them): the hand-over, in both
    directions, about as often as it can happen."""

    def __init__(self) -> None:
        super().__init__()
        self.switches = 0

    @property
    def window_batches(self) -> int:
        return 1

    def window(self, window: Window) -> bool:
        self.switches += 1
        return not window.threaded
