"""Whether the loop should take calls of a DataLoader with workers from the running thread
(issue #16).

Without workers, a loop that finds nothing ready while the thread stage's thread is between two
calls of the source makes the next batch itself (``ThreadStage``'s ``steal``): that saves a
wake-up. With workers, a call mostly waits for a worker's batch, and the loop that makes it
waits there, where the thread would have waited beside the loop's step. This program times one
constant loop of the grid (``--cell KIND,D,C``, D and C in us, with ``--workers``) in four arms,
interleaved in paired rounds (`prefetchx.bench.paired.round_order`):

* ``plain``: DataLoader, the baseline;
* ``steal``: the thread stage kept on (no choice made), the loop taking calls from the thread;
* ``no steal``: the same, the thread making every batch, as DataLoaderX does over workers
  (`prefetchx._pipeline.Pipeline.fed_by`);
* ``recipe``: the BackgroundGenerator recipe.

Each arm's figure is the median over rounds (the first left out) of its throughput over
plain's in the same round.

``--noise N`` runs N other processes beside the rounds, each burning a CPU in bursts of 10 to
60 ms, 50 to 400 ms apart (seeded): a machine that other work slows at random moments, where
the thread is descheduled at times with nothing queued and the loop takes the call. In numpy,
2 ms and 2 ms without workers, on the 2-core VM with 2 such processes, 30 rounds read the two
thread arms and the recipe alike (1.640x, 1.627x and 1.643x plain).

Usage:
    python benchmarks/steal.py [--cell python,200,20] [--workers 2] [--rounds 100]
        [--epoch-ms 250] [--noise N] [--quick] [--out STEM]

``--out benchmarks/results/steal-cpu-2core`` writes ``steal-cpu-2core.txt`` (what it prints)
and ``steal-cpu-2core.json`` (every epoch's time, the machine, the versions and the commit).
``--quick`` is a run of seconds for tests.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grid  # benchmarks/grid.py, beside this program
import kept_alone  # its --cell type

from prefetchx.bench.paired import round_order
from prefetchx.bench.record import integer_at_least, meta_line
from prefetchx.bench.synthetic import ARMS as LOADERS
from prefetchx.bench.synthetic import Work, WorkDataset, machine_meta, release, run_epoch

MAX_PREFETCH = 2
ARMS = ("plain", "steal", "no steal", "recipe")
BURST_S = (0.01, 0.06)
"""How long each burst of ``--noise`` burns a CPU, at least and at most."""
GAP_S = (0.05, 0.4)
"""How long ``--noise`` sleeps between two bursts, at least and at most."""


def _burn(seed: int, stop: Any) -> None:
    """Burn a CPU in bursts until ``stop`` is set (a `multiprocessing.Event`)."""
    rng = random.Random(seed)
    while not stop.is_set():
        end = time.perf_counter() + rng.uniform(*BURST_S)
        while time.perf_counter() < end:
            pass
        time.sleep(rng.uniform(*GAP_S))


@contextmanager
def noise(processes: int) -> Iterator[None]:
    """``processes`` other processes burning CPUs in bursts while the block runs."""
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(n, stop)) for n in range(processes)]
    for burner in burners:
        burner.start()
    try:
        yield
    finally:
        stop.set()
        for burner in burners:
            burner.join()


def run(cell: grid.Cell, rounds: int) -> dict[str, list[float]]:
    """Every arm's epoch times over ``rounds`` paired rounds of ``cell``."""
    data, steps = Work(cell.kind, cell.data_ms), grid.Steps(cell.kind, cell.steps_ms())
    dataset = WorkDataset(cell.batches, data)
    common = {"batch_size": None, "num_workers": cell.workers}
    common["persistent_workers"] = cell.workers > 0

    def made(arm: str) -> Any:
        return LOADERS[arm](dataset, MAX_PREFETCH, common)

    loaders: dict[str, Iterable[Any]] = {
        "plain": made("plain"),
        "steal": grid.ForcedThread(made("plain"), MAX_PREFETCH, steal=True),
        "no steal": grid.ForcedThread(made("plain"), MAX_PREFETCH, steal=False),
        "recipe": made("recipe"),
    }
    seconds: dict[str, list[float]] = {arm: [] for arm in loaders}
    try:
        for n in range(rounds):
            for index in round_order(len(ARMS), n):
                steps.restart()
                seconds[ARMS[index]].append(run_epoch(loaders[ARMS[index]], steps))
    finally:
        for loader in loaders.values():
            release(loader.loader if isinstance(loader, grid.ForcedThread) else loader)
    return seconds


def figures(seconds: dict[str, list[float]]) -> dict[str, float]:
    """Each arm's median throughput over plain's in the same round, the first round left out."""
    plain = seconds["plain"][1:]
    return {
        arm: statistics.median(p / t for p, t in zip(plain, times[1:], strict=True))
        for arm, times in seconds.items()
    }


def render(meta: dict[str, Any], cell: grid.Cell, got: dict[str, float]) -> str:
    lines = [
        meta_line(meta),
        "",
        f"{cell.label}, {cell.batches} batches an epoch; {meta['rounds']} paired rounds, "
        "figures over the rounds after the first"
        + (f"; {meta['noise']} processes burning CPUs in bursts beside" if meta["noise"] else ""),
        "",
        f"{'arm':<9} {'vs plain':>9}",
        *(f"{arm:<9} {value:>8.3f}x" for arm, value in got.items()),
        "",
        "vs plain: the arm's throughput over plain's in the same round, median",
        "",
        conclude(got, meta["quick"]),
    ]
    return "\n".join(lines) + "\n"


def conclude(got: dict[str, float], quick: bool) -> str:
    gain = got["no steal"] / got["steal"] - 1
    text = (
        f"The thread making every batch ran {abs(gain):.1%} "
        f"{'faster' if gain >= 0 else 'slower'} than the loop taking calls from it "
        f"({got['no steal']:.3f}x against {got['steal']:.3f}x plain; the recipe "
        f"{got['recipe']:.3f}x)."
    )
    return text + (" (A quick run: too few rounds to conclude from.)" if quick else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cell", type=kept_alone.cell_of, default=("python", 200.0, 20.0))
    parser.add_argument("--workers", type=integer_at_least(0), default=2, metavar="N")
    parser.add_argument("--rounds", type=integer_at_least(2), default=100, metavar="N")
    parser.add_argument("--epoch-ms", type=float, default=250.0, metavar="MS")
    parser.add_argument(
        "--noise",
        type=integer_at_least(0),
        default=0,
        metavar="N",
        help="other processes burning CPUs in bursts beside the rounds (default 0)",
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of short epochs (tests)")
    parser.add_argument("--out", metavar="STEM", help="write STEM.txt and STEM.json")
    args = parser.parse_args(argv)
    if not args.epoch_ms > 0:
        parser.error(f"--epoch-ms must be above 0, got {args.epoch_ms}")
    rounds, epoch_ms = (3, 20.0) if args.quick else (args.rounds, args.epoch_ms)
    kind, data_us, step_us = args.cell
    one = grid.Cell(kind, args.workers, data_us / 1e3, step_us / 1e3)
    cell = kept_alone.sized(one, epoch_ms)
    meta = {**machine_meta(), "rounds": rounds, "epoch_ms": epoch_ms, "quick": args.quick}
    meta["noise"] = args.noise
    with noise(args.noise):
        seconds = run(cell, rounds)
    got = figures(seconds)
    text = render(meta, cell, got)
    print(text, end="")
    if args.out:
        Path(f"{args.out}.txt").write_text(text)
        record = {"meta": meta, "cell": cell.label, "figures": got, "epochs_s": seconds}
        record["conclusion"] = conclude(got, args.quick)
        Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
