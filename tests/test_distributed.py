"""DataLoaderX under torch.distributed: two gloo ranks on the CPU train a DDP model.

torchrun runs this file as each rank's script (see ``__main__`` at the end). A rank trains for two
epochs from a DataLoaderX over a `DistributedSampler`, reads the same epochs from a plain
`DataLoader` over the same sampler, and saves what it saw. The checks run in the test process,
over both ranks' records. Ranks under torchrun rather than spawned from the test process: a spawn
context leaves multiprocessing's resource tracker running in it for the rest of the session.

When a run fails, the test says where each process was: a rank that makes no progress for
`STALL_AFTER` seconds writes every thread's stack to a file, and so does a worker still running
that long after it started; the failure message shows those files before torchrun's output.
Issue #17 has the analysis of the one failure seen: both ranks stay in step at every collective,
cold or starved (measured), so a rank stuck for the 60 s collective timeout is either stuck or
the whole machine stood still; `tests.helpers.torchrun` measures the latter and runs once more.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import gc
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, TextIO

import psutil
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from prefetchx import DataLoaderX
from tests.helpers import TORCHRUN_TIMEOUT, Pauses, torchrun, wait_until

pytestmark = pytest.mark.timeout(2 * TORCHRUN_TIMEOUT + 20)
"""`torchrun` runs twice when the machine stood still during a failed first run."""

WORLD_SIZE = 2
SAMPLES = 40  # divisible by WORLD_SIZE: DistributedSampler pads with repeats otherwise
BATCH_SIZE = 6  # 20 samples per rank: three full batches and a partial one
EPOCHS = 2
SEED = 11
NUM_WORKERS = (0, 2)

HANG = float(os.environ.get("PREFETCHX_TEST_HANG", "0"))
"""Set (seconds) only by `test_a_hung_rank_fails_the_run_and_says_where`: rank 0's workers hang
for twice that long, and the timeouts below shrink to it, so that test sees a real hang caught."""

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=HANG or 60)
"""A rank waiting this long in a collective for the other fails instead of hanging."""

STALL_AFTER = COLLECTIVE_TIMEOUT.total_seconds() / 3
"""Seconds without progress after which a rank writes every thread's stack to its stacks file (and
seconds after which a worker still running writes its own): well inside `COLLECTIVE_TIMEOUT`, so
a rank that keeps the other waiting says where it is before the other gives up. Progress re-arms
the rank's timer, so a slow machine writes nothing."""

STARTUP_STALL_AFTER = 60.0
"""`STALL_AFTER` for a rank until its first epoch has run. Starting up (joining the group, and
the imports that DDP, the first step and the optimizer make lazily) takes seconds on a loaded
machine, and is no stall. And faulthandler dumps a thread's stack from its watchdog thread while
the thread runs: during an import that can crash the process. A rank died so in a local CI run
(SIGSEGV, its stacks file inside ``torch._dynamo``'s imports 1.7 s in), and importing torch with
a dump every 5 ms crashed 6 runs in 6 on the 2-core VM."""

SLOW_START = float(os.environ.get("PREFETCHX_TEST_SLOW_START", "0"))
"""Set (seconds) only by `test_a_hung_rank_fails_the_run_and_says_where`: rank 0 takes this much
longer to start, past `STALL_AFTER`, as on a loaded machine."""


def _stacks_file(out_dir: str, name: str) -> TextIO:
    return open(os.path.join(out_dir, f"stacks-{name}-pid{os.getpid()}.txt"), "w")


def _watch_worker(out_dir: str, rank: int, worker_id: int) -> None:
    """In a worker: write its stacks once, `STALL_AFTER` s after it starts, if still running.

    Not `faulthandler.dump_traceback_later`: in a child forked from a rank that armed it, it waits
    forever on the rank's watchdog thread, which the child does not have.
    """

    def dump() -> None:
        with _stacks_file(out_dir, f"rank{rank}-worker{worker_id}") as file:
            faulthandler.dump_traceback(file=file)

    timer = threading.Timer(STALL_AFTER, dump)
    timer.daemon = True
    timer.start()


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Item ``i``: 4 features and a target computed from ``i``, and ``i`` itself."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if HANG and os.environ["RANK"] == "0" and torch.utils.data.get_worker_info() is not None:
            time.sleep(2 * HANG)  # past rank 1's timeout; ends by itself, so nothing is left behind
        x = torch.arange(4, dtype=torch.float32) * (i + 1) / SAMPLES
        return x, torch.tensor(float(i % 3)), i


def _run_rank(out_dir: str) -> None:
    """One rank: DDP training from DataLoaderX, and the plain DataLoader's epochs beside it."""
    stacks = _stacks_file(out_dir, f"rank{os.environ['RANK']}")
    # Each call re-arms the timer: the stacks are written only after so long without one.
    progress = functools.partial(
        faulthandler.dump_traceback_later, STARTUP_STALL_AFTER, file=stacks
    )
    progress()
    if SLOW_START and os.environ["RANK"] == "0":
        time.sleep(SLOW_START)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)  # torchrun's environment
    progress()
    rank = dist.get_rank()
    try:
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        module = torch.nn.Linear(4, 1)
        record: dict[str, Any] = {"initial": [p.detach().clone() for p in module.parameters()]}
        model = DistributedDataParallel(module)
        progress()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dataset = Indexed()
        sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
        for num_workers in NUM_WORKERS:
            kwargs: dict[str, Any] = {
                "batch_size": BATCH_SIZE,
                "sampler": sampler,
                "num_workers": num_workers,
                "worker_init_fn": functools.partial(_watch_worker, out_dir, rank)
                if num_workers
                else None,
            }
            ours = DataLoaderX(dataset, **kwargs)
            plain = DataLoader(dataset, **kwargs)
            for epoch in range(EPOCHS):
                sampler.set_epoch(epoch)
                trained: list[Batch] = []
                for x, y, index in ours:
                    optimizer.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
                    loss.backward()  # all-reduces the gradients with the other rank
                    optimizer.step()
                    trained.append((x, y, index))
                    progress()
                record[f"ours/{num_workers}/{epoch}"] = trained
                record[f"plain/{num_workers}/{epoch}"] = list(plain)
                # Started up: from here on, a rank that stands still is stalled.
                progress = functools.partial(
                    faulthandler.dump_traceback_later, STALL_AFTER, file=stacks
                )
                progress()
            ours.close()
        record["final"] = [p.detach().clone() for p in model.parameters()]
        record["leaks"] = _leaks_after_close()
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()
        dist.destroy_process_group()


def _leaks_after_close() -> list[str]:
    """The prefetchx threads and worker processes still alive in this rank after a grace time."""

    def leaks() -> list[str]:
        gc.collect()
        threads = [t.name for t in threading.enumerate() if t.name.startswith("prefetchx-")]
        workers = [f"pid {p.pid}" for p in psutil.Process().children(recursive=True)]
        return threads + workers

    wait_until(lambda: not leaks(), timeout=15)
    return leaks()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' records, from one torchrun that every test of this module reads."""
    out_dir = tmp_path_factory.mktemp("ddp")
    returncode, out, err = torchrun("tests/test_distributed.py", str(out_dir))
    assert returncode == 0, _failure(returncode, out, err, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def _failure(returncode: int, out: str, err: str, out_dir: str) -> str:
    """What a failed run says: the stacks each stalled process wrote (a rank's file starts with
    how long it had gone without progress), then torchrun's output (a rank's exception reaches its
    stderr with the traceback)."""
    parts = [f"exit status {returncode}"]
    for path in sorted(glob.glob(os.path.join(out_dir, "stacks-*.txt"))):
        with open(path) as file:
            text = file.read()
        if text:
            parts.append(f"--- {os.path.basename(path)}:\n{text}")
    parts += ["--- torchrun's stdout:", out, "--- torchrun's stderr, the end:", err[-4000:]]
    return "\n".join(parts)


def _indices(batches: list[Batch]) -> list[int]:
    return [i for _, _, index in batches for i in index.tolist()]


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
def test_ranks_split_each_epoch_disjointly_and_cover_the_dataset(
    ranks: list[dict[str, Any]], num_workers: int
) -> None:
    for epoch in range(EPOCHS):
        seen = [_indices(record[f"ours/{num_workers}/{epoch}"]) for record in ranks]
        assert all(len(s) == SAMPLES // WORLD_SIZE for s in seen), [len(s) for s in seen]
        assert not set(seen[0]) & set(seen[1]), f"epoch {epoch}: a sample went to both ranks"
        assert sorted(seen[0] + seen[1]) == list(range(SAMPLES)), f"epoch {epoch}"


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
def test_set_epoch_reshuffles(ranks: list[dict[str, Any]], num_workers: int) -> None:
    for rank, record in enumerate(ranks):
        orders = [_indices(record[f"ours/{num_workers}/{epoch}"]) for epoch in range(EPOCHS)]
        assert orders[0] != orders[1], f"rank {rank}: both epochs came in the same order"


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
def test_each_rank_gets_the_plain_dataloaders_batches(
    ranks: list[dict[str, Any]], num_workers: int
) -> None:
    for rank, record in enumerate(ranks):
        for epoch in range(EPOCHS):
            ours = record[f"ours/{num_workers}/{epoch}"]
            plain = record[f"plain/{num_workers}/{epoch}"]
            assert len(ours) == len(plain) == 4
            for got, want in zip(ours, plain, strict=True):
                for a, b in zip(got, want, strict=True):
                    assert a.dtype == b.dtype
                    assert torch.equal(a, b), f"rank {rank}, epoch {epoch}"


def test_ddp_kept_the_ranks_in_step(ranks: list[dict[str, Any]]) -> None:
    # The ranks started from different weights and trained on different samples: equal weights
    # at the end mean DDP broadcast rank 0's weights and all-reduced every step's gradients.
    first, second = (record["final"] for record in ranks)
    assert not all(torch.equal(a, b) for a, b in zip(*(r["initial"] for r in ranks), strict=True))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["initial"], first, strict=True))


def test_no_rank_left_a_thread_or_a_worker(ranks: list[dict[str, Any]]) -> None:
    for rank, record in enumerate(ranks):
        assert record["leaks"] == [], f"rank {rank}"


def test_a_hung_rank_fails_the_run_and_says_where(tmp_path: Any) -> None:
    # Rank 0's workers hang in the first batch with workers: rank 1 times out in its collective,
    # and the message shows rank 0's stacks, in the loop, and its workers', in the dataset.
    # Rank 0 also starts slowly: that is no stall, and its stacks are written once, in the loop.
    returncode, out, err = torchrun(
        "tests/test_distributed.py",
        str(tmp_path),
        PREFETCHX_TEST_HANG="5",
        PREFETCHX_TEST_SLOW_START="2",
    )
    message = _failure(returncode, out, err, str(tmp_path))
    assert returncode != 0, message
    assert "Timed out waiting" in err, message
    assert "this process stood still for at most" in err, message
    rank0 = glob.glob(str(tmp_path / "stacks-rank0-pid*.txt"))
    workers = glob.glob(str(tmp_path / "stacks-rank0-worker*-pid*.txt"))
    assert len(rank0) == 1, message
    assert workers, message
    with open(rank0[0]) as file:
        stacks = file.read()
    assert stacks.count("Timeout (") == 1, message
    assert "in _run_rank" in stacks, message
    assert "prefetchx" in stacks, message  # waiting for the batch, inside DataLoaderX
    for path in workers:
        with open(path) as file:
            assert "in __getitem__" in file.read(), message
    assert f"--- {os.path.basename(rank0[0])}" in message


def test_pauses_measures_how_long_this_process_stood_still() -> None:
    # The process stops itself; a child resumes it a second later (and again, to be safe).
    with Pauses() as pauses:
        waker = subprocess.Popen(
            ["sh", "-c", f"sleep 1; kill -CONT {os.getpid()}; sleep 2; kill -CONT {os.getpid()}"]
        )
        os.kill(os.getpid(), signal.SIGSTOP)
    waker.wait()
    assert 0.8 <= pauses.longest < 10, pauses.longest


if __name__ == "__main__":
    _run_rank(sys.argv[1])
