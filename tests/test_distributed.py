"""DataLoaderX under torch.distributed: two gloo ranks on the CPU train a DDP model.

torchrun runs this file as each rank's script (see ``__main__`` at the end). A rank trains for two
epochs from a DataLoaderX over a `DistributedSampler`, reads the same epochs from a plain
`DataLoader` over the same sampler, and saves what it saw. The checks run in the test process,
over both ranks' records. Ranks under torchrun rather than spawned from the test process: a spawn
context leaves multiprocessing's resource tracker running in it for the rest of the session.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
import subprocess
import sys
import threading
from typing import Any

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

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
"""A rank waiting this long in a collective for the other fails instead of hanging."""

STACKS_AFTER = 45.0
"""Seconds after which each rank and each worker prints every thread's stack to stderr, again
every as many seconds: a rank stuck before the collective timeout then shows where it is."""


def _watch_stacks() -> None:
    """In a rank: dump all threads' stacks to stderr every `STACKS_AFTER` seconds."""
    faulthandler.dump_traceback_later(STACKS_AFTER, repeat=True, file=sys.stderr)


def _watch_worker(worker_id: int) -> None:
    """In a worker: dump its stacks once after `STACKS_AFTER` seconds if it is still running.

    Not `dump_traceback_later`: in a child forked from a rank that armed it, it waits forever
    on the rank's watchdog thread, which the child does not have.
    """
    timer = threading.Timer(STACKS_AFTER, faulthandler.dump_traceback, kwargs={"file": sys.stderr})
    timer.daemon = True
    timer.start()


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Item ``i``: 4 features and a target computed from ``i``, and ``i`` itself."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.arange(4, dtype=torch.float32) * (i + 1) / SAMPLES
        return x, torch.tensor(float(i % 3)), i


def _run_rank(out_dir: str) -> None:
    """One rank: DDP training from DataLoaderX, and the plain DataLoader's epochs beside it."""
    _watch_stacks()
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)  # torchrun's environment
    rank = dist.get_rank()
    try:
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        module = torch.nn.Linear(4, 1)
        record: dict[str, Any] = {"initial": [p.detach().clone() for p in module.parameters()]}
        model = DistributedDataParallel(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dataset = Indexed()
        sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
        for num_workers in NUM_WORKERS:
            kwargs: dict[str, Any] = {
                "batch_size": BATCH_SIZE,
                "sampler": sampler,
                "num_workers": num_workers,
                "worker_init_fn": _watch_worker if num_workers else None,
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
                record[f"ours/{num_workers}/{epoch}"] = trained
                record[f"plain/{num_workers}/{epoch}"] = list(plain)
            ours.close()
        record["final"] = [p.detach().clone() for p in model.parameters()]
        record["leaks"] = _leaks_after_close()
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        faulthandler.cancel_dump_traceback_later()
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
    # A rank's exception reaches torchrun's stderr with its traceback.
    assert returncode == 0, f"exit status {returncode}\n{out}\n{err[-6000:]}"
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


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
