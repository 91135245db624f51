"""The JPEG pipeline: DataLoaderX against a plain DataLoader on a realistic CPU training loop.

The dataset decodes a JPEG, crops and flips it (PIL); the step trains a small conv net on the
CPU (`prefetchx.bench.jpeg`). Every arm normalizes in its collate function, with DataLoaderX's
own normalization, so in the same place. The loop runs at 1 and 2 torch threads and with 0, 1
and 2 persistent workers; each arm runs one untimed epoch first, then the arms run in paired
rounds (`prefetchx.bench.paired`): plain DataLoader, DataLoaderX, the BackgroundGenerator
recipe, DataLoaderX with ``max_prefetch=0``, a run-ahead ``queue.SimpleQueue`` thread (the
floor of a threaded hand-off), a second plain DataLoader and a second recipe (each against its
first: the noise of the targets' comparisons).

Usage:
    python benchmarks/jpeg_pipeline.py [--quick] [--rounds N] [--images N] [--out STEM]
        [--threads N [N ...]] [--workers N [N ...]]

``--out benchmarks/results/jpeg_pipeline-cpu-2core`` writes ``jpeg_pipeline-cpu-2core.txt``
(the table, its legend and summary) and ``jpeg_pipeline-cpu-2core.json`` (every round's
times, the machine, the versions and the commit). ``--quick`` is a run of seconds for tests.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

from prefetchx.bench.jpeg import JpegResult, jpeg_files, measure_jpeg
from prefetchx.bench.paired import CLEAR, ratios
from prefetchx.bench.record import add_options, meta_line, report
from prefetchx.bench.synthetic import (
    VS_PLAIN,
    conclude,
    explain,
    machine_meta,
    wrap,
)

THREADS = (1, 2)
WORKERS = (0, 1, 2)
ARM_ORDER = ("plain", "prefetchx", "recipe", "inline", "floor", "again", "recipe again")

COLUMNS = {
    "threads": "torch's intra-op threads for the step",
    "wkr": "DataLoader workers, persistent",
    "plain ms": "the plain arm's median epoch time",
    "ARM": f"(one column per arm) {VS_PLAIN}",
    "stall meter": "DataLoaderX's verdict on its last epoch (`loader.stats.verdict()`)",
}


def format_table(results: list[JpegResult]) -> str:
    """One line per configuration, then DataLoaderX's stall meter for each."""
    arms = ARM_ORDER[1:]
    head = f"{'threads':>7} {'wkr':>3} {'plain ms':>9}  " + " ".join(f"{a:<18}" for a in arms)
    lines = [head.rstrip()]
    for r in results:
        plain_ms = statistics.median(r.epochs_s["plain"]) * 1e3
        lines.append(
            (
                f"{r.torch_threads:>7} {r.num_workers:>3} {plain_ms:>9.1f}  "
                + " ".join(f"{r.spread(arm).ratio():<18}" for arm in arms)
            ).rstrip()
        )
    lines.append("")
    lines.append("stall meter:")
    lines += [wrap(f"{r.label.removeprefix('JPEG, ')}: {r.verdict}") for r in results]
    return "\n".join(lines)


def legend(images: int, batch_size: int) -> str:
    """What each column and each arm of the table means."""
    return explain(
        COLUMNS,
        ARM_ORDER,
        f"Each epoch: {images} JPEGs decoded, cropped and flipped in the dataset, batches of "
        f"{batch_size}, a conv net step on each; every arm normalizes in its collate_fn "
        "(DataLoaderX's own normalization), so in the same place.",
    )


def of_recipe(result: JpegResult, arm: str = "prefetchx") -> float:
    """``arm`` against the recipe in a configuration where the recipe wins: the median, over
    the rounds, of the recipe's epoch over ``arm``'s in the same round (as `grid.py`'s
    ``of_best``); without the epochs, the ratio of their medians over plain."""
    epochs = result.epochs_s
    if arm in epochs and "recipe" in epochs:
        return ratios(epochs, base="recipe")[arm].median
    return result.spread(arm).median / result.spread("recipe").median


def summarize(results: list[JpegResult]) -> tuple[dict[str, Any], str]:
    """The figures issue #16's targets read, for the record and as the text's lines:
    DataLoaderX's worst configuration over plain, with plain against itself there; the lowest
    figure of plain against itself; and, where the recipe beats plain by more than `CLEAR`,
    DataLoaderX against the recipe (the best there), paired by round (`of_recipe`), and the
    second recipe alike (the recipe against itself: an arm as fast as the recipe falls below
    the line by this much at random)."""
    worst = min(results, key=lambda r: r.spread("prefetchx").median)
    noisiest = min(results, key=lambda r: r.spread("again").median)
    winning = [(r, of_recipe(r)) for r in results if r.spread("recipe").median > 1 + CLEAR]
    summary: dict[str, Any] = {
        "worst": {
            "configuration": worst.label,
            **asdict(worst.spread("prefetchx")),
            "again": asdict(worst.spread("again")),
        },
        "noise": {"configuration": noisiest.label, **asdict(noisiest.spread("again"))},
        "winning": len(winning),
        "winning_worst": None,
    }
    lines = [
        f"worst configuration: DataLoaderX at {worst.spread('prefetchx').ratio()} of plain "
        f"({worst.label}; target >= 0.97); plain against itself "
        f"{worst.spread('again').ratio()} there",
        f"noise: plain against itself {noisiest.spread('again').ratio()} at the lowest "
        f"({noisiest.label})",
    ]
    if winning:
        lowest, share = min(winning, key=lambda pair: pair[1])
        summary["winning_worst"] = {"configuration": lowest.label, "of_best": share}
        line = (
            f"winning configurations (the recipe faster than plain by more than "
            f"{CLEAR:.0%}): {len(winning)}; the lowest, DataLoaderX at {share:.3f} of the "
            f"recipe ({lowest.label}; target >= 0.97)"
        )
        twins = [
            (r, of_recipe(r, "recipe again")) for r, _ in winning if "recipe again" in r.ratios
        ]
        if twins:
            twin, twin_share = min(twins, key=lambda pair: pair[1])
            summary["winning_noise"] = {"configuration": twin.label, "of_best": twin_share}
            line += f"; the recipe against itself {twin_share:.3f} at the lowest ({twin.label})"
        lines.append(line)
    else:
        lines.append(
            f"winning configurations: none (the recipe beat plain by more than {CLEAR:.0%} nowhere)"
        )
    return summary, "Summary:\n" + "\n".join(wrap(line) for line in lines)


def parser() -> argparse.ArgumentParser:
    """The command line of this program."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="8 images, 1 torch thread, 0 and 1 workers (tests)"
    )
    p.add_argument("--images", type=int, default=512, metavar="N", help="per epoch (512)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="default 16")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        metavar="N",
        help="torch threads to run (default 1 2; 1 with --quick): fewer, to fit a time limit",
    )
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        metavar="N",
        help="DataLoader workers to run (default 0 1 2; 0 1 with --quick)",
    )
    add_options(p, "benchmarks/results/jpeg_pipeline-cpu-2core")
    return p


def main(argv: list[str] | None = None) -> int:
    command_line = parser()
    args = command_line.parse_args(argv)
    images, batch_size = (8, 4) if args.quick else (args.images, args.batch_size)
    threads, workers = ((1,), (0, 1)) if args.quick else (THREADS, WORKERS)
    threads, workers = args.threads or threads, args.workers or workers
    for name, values, low in (("--threads", threads, 1), ("--workers", workers, 0)):
        if min(values) < low:
            command_line.error(f"{name} must be >= {low}, got {min(values)}")
    meta = {
        **machine_meta(),
        "rounds": args.rounds,
        "images": images,
        "batch_size": batch_size,
        "max_prefetch": args.max_prefetch,
        "quick": args.quick,
    }
    print(meta_line(meta), flush=True)
    log = functools.partial(print, file=sys.stderr, flush=True)
    started = time.perf_counter()
    results = []
    with jpeg_files(images) as paths:
        for t in threads:
            for w in workers:
                results.append(
                    measure_jpeg(
                        w,
                        torch_threads=t,
                        images=images,
                        batch_size=batch_size,
                        rounds=args.rounds,
                        arms=ARM_ORDER,
                        max_prefetch=args.max_prefetch,
                        paths=paths,
                        progress=log,
                    )
                )
    summary, summary_text = summarize(results)
    conclusion = conclude([(r.label, r.spread("prefetchx")) for r in results], quick=args.quick)
    report(
        args.out,
        meta,
        [
            f"JPEG pipeline: {len(results)} configurations, {args.rounds} paired rounds each, "
            f"arms interleaved in one process; {time.perf_counter() - started:.0f} s",
            format_table(results),
            legend(images, batch_size),
            summary_text,
        ],
        conclusion,
        COLUMNS,
        ARM_ORDER,
        results=[asdict(r) for r in results],
        summary=summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
