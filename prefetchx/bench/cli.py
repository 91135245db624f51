"""The ``bench`` command: ``python -m prefetchx bench`` (or ``prefetchx bench``).

Measures what prefetching saves on this machine: a synthetic loop with three kinds of work, a
JPEG-decoding CPU workload, and, where CUDA is present, copy bandwidth and an end-to-end GPU step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from prefetchx import __version__
from prefetchx.bench.record import depth
from prefetchx.bench.synthetic import (
    WARM_BATCHES,
    ArmResult,
    Case,
    Loop,
    as_rows,
    conclude,
    format_table,
    legend,
    machine_meta,
    measure,
    wrap,
)

if TYPE_CHECKING:
    from prefetchx.bench.jpeg import JpegResult

CONTROL = "the control: the GIL leaves nothing to overlap"
NO_RECIPE = "the recipe left out: it is 5-10x slower here"
NO_RECIPE_ARMS = ("plain", "again", "prefetchx", "warmed")

DEFAULT_GRID = [
    Case("sleep", 5, 5, 50),  # the overlap-efficiency target
    Case("sleep", 10, 5, 30),  # data dominates
    Case("numpy", 5, 5, 40),
    Case("python", 5, 5, 40, note=CONTROL),
    # No step work: long epochs, as each batch costs only microseconds, and the recipe apart.
    Case("sleep", 0, 0, 20000, rounds=7, arms=NO_RECIPE_ARMS, note=NO_RECIPE),
    Case("sleep", 0, 0, 2000, note="shorter epochs, to run the recipe too"),
]
QUICK_GRID = [
    Case("sleep", 2, 2, 20),
    Case("python", 1, 1, 20, note=CONTROL),
    Case("sleep", 0, 0, 2000, arms=NO_RECIPE_ARMS, note=NO_RECIPE),
]
JPEG_WORKERS = (0, 2)
JPEG_IMAGES = 256
JPEG_BATCH = 16
JPEG_ARMS = ("plain", "again", "recipe", "prefetchx")
"""The JPEG workload's arms: ``again``, plain against itself, gives each row its noise."""


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    return {**machine_meta(), "max_prefetch": args.max_prefetch, "quick": args.quick}


def _synthetic(args: argparse.Namespace) -> list[ArmResult]:
    print(
        "\n== Synthetic loop: per-batch data and step cost, one kind of work; arms in paired "
        "rounds, each a new loader timed from its first batch (construction, iter() and every "
        f"batch), but 'warmed', one loader after {WARM_BATCHES} untimed batches =="
    )
    results: list[ArmResult] = []
    for case in QUICK_GRID if args.quick else DEFAULT_GRID:
        results.extend(measure(case, max_prefetch=args.max_prefetch, progress=_log))
    print(format_table(results), flush=True)
    print(legend(r.arm for r in results))
    return results


def _jpeg(args: argparse.Namespace) -> list[JpegResult]:
    print(
        f"\n== JPEG decode, crop and flip in the dataset, small conv net step on the CPU "
        f"({JPEG_IMAGES} images, batch {JPEG_BATCH}) =="
    )
    try:
        import PIL  # noqa: F401
    except ImportError:
        print('skipped: needs pillow (pip install "prefetchx[bench]")')
        return []
    from prefetchx.bench.jpeg import jpeg_files, measure_jpeg

    arms = JPEG_ARMS
    print(
        (
            f"{'threads':>7} {'workers':>7} {'plain ms':>9}  "
            + "  ".join(f"{arm + ' vs plain':<19}" for arm in arms[1:])
        ).rstrip()
    )
    results = []
    with jpeg_files(JPEG_IMAGES) as paths:
        for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
            for workers in JPEG_WORKERS:
                r = measure_jpeg(
                    workers,
                    torch_threads=threads,
                    images=JPEG_IMAGES,
                    batch_size=JPEG_BATCH,
                    arms=arms,
                    max_prefetch=args.max_prefetch,
                    paths=paths,
                    progress=_log,
                )
                plain_ms = statistics.median(r.epochs_s["plain"]) * 1e3
                print(
                    (
                        f"{threads:>7} {workers:>7} {plain_ms:>9.1f}  "
                        + "  ".join(f"{r.spread(arm).ratio():<19}" for arm in arms[1:])
                    ).rstrip(),
                    flush=True,
                )
                results.append(r)
    print("DataLoaderX's stall meter on its last epoch:")
    for r in results:
        print(wrap(f"{r.label.removeprefix('JPEG, ')}: {r.verdict}"))
    print(
        wrap(
            "Columns: threads: torch's intra-op threads for the step; workers: DataLoader "
            "workers, persistent; plain ms: the plain arm's median epoch time; ARM vs plain: "
            "as in the synthetic table. Every arm normalizes in its collate_fn, with "
            "DataLoaderX's own normalization, so all in the same place: a worker, or without "
            "workers the thread that makes the batch. again: a second plain DataLoader, plain "
            "against itself: its spread is the noise. Unlike the synthetic loop's, these "
            "loaders are warmed: each arm runs one untimed epoch before the rounds (its "
            "workers started), and DataLoaderX keeps its choice from it.",
            indent="",
        )
    )
    return results


def _cuda() -> dict[str, Any]:
    """Run every GPU measurement, print a table for each, and return them all."""
    from prefetchx.bench.cuda import measure_blocking, measure_copy, measure_meter, measure_step

    print(f"\n== CUDA: {torch.cuda.get_device_name()} ==")
    print("copy bandwidth, timed from the first batch (target >= 0.90 of raw from 16 MB up)")
    print(f"{'MB':>6} {'raw GB/s':>9} {'prefetchx GB/s':>15} {'ratio':>6}")
    copies = []
    for mb in (4, 16, 64, 256):
        c = measure_copy(mb)
        print(f"{mb:>6} {c.raw_gbps:>9.1f} {c.prefetchx_gbps:>15.1f} {c.ratio:>6.2f}", flush=True)
        copies.append(asdict(c))
    b = measure_blocking()
    print(
        f"\nnext() behind {b.busy_ms:.0f} ms of queued GPU work, {b.megabytes} MB batch: "
        f"pinned {b.pinned_next_ms:.1f} ms, pageable {b.pageable_next_ms:.1f} ms",
        flush=True,
    )
    print(f"\n{'arm':>12} {'epoch ms':>9} {'vs data-on-gpu':>15}  (same workers for every arm)")
    steps = []
    for s in measure_step():
        print(f"{s.arm:>12} {s.epoch_s * 1e3:>9.1f} {s.vs_bound:>14.3f}x", flush=True)
        steps.append(asdict(s))
    m = measure_meter()
    print(
        f"\nGPU stall meter: {m.cost_us:.1f} us per batch; with {m.delay_ms:.0f} ms of producer "
        f"delay per batch the epoch grew {m.epoch_growth_ms:.2f} ms per batch and the meter's "
        f"idle time {m.idle_growth_ms:.2f} ms (medians of {m.rounds} paired epochs)",
        flush=True,
    )
    return {"copy": copies, "blocking": asdict(b), "step": steps, "meter": asdict(m)}


def conclusion(synthetic: list[ArmResult], jpeg: list[JpegResult], quick: bool = False) -> str:
    """The sentence a run ends with: a new DataLoaderX against plain in every loop it measured,
    each read with plain against itself in the same rounds where the loop has it."""
    twins = {id(r.case): r.spread for r in synthetic if r.arm == "again"}
    loops: list[Loop] = [
        (r.case.label, r.spread, twins.get(id(r.case))) for r in synthetic if r.arm == "prefetchx"
    ]
    loops += [
        (r.label, r.spread("prefetchx"), r.spread("again") if "again" in r.ratios else None)
        for r in jpeg
    ]
    return conclude(loops, arm="a new DataLoaderX", quick=quick)


def _bench(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    meta = _meta(args)
    print(
        f"prefetchx {__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, commit {meta['commit']}"
    )
    synthetic = _synthetic(args)
    jpeg = [] if args.quick else _jpeg(args)
    cuda = _cuda() if torch.cuda.is_available() and not args.cpu_only else {}
    summary = conclusion(synthetic, jpeg, quick=args.quick)
    record = {
        "meta": meta,
        "results": as_rows(synthetic),
        "jpeg": [asdict(r) for r in jpeg],
        "cuda": cuda,
        "conclusion": summary,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from prefetchx.bench import plot

        plot.save(record, args.plot)
        print(f"wrote {args.plot}")
    print(f"\ndone in {time.perf_counter() - started:.0f} s\n")
    print(wrap(summary, indent=""))  # the last word: what to conclude for this machine
    return 0


# Each check runs while the arguments are parsed, so a bad value is a usage error naming the
# option and the value before the bench starts, not a traceback after it.


def _output(value: str) -> str:
    folder = os.path.dirname(value) or "."
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory; give a file name in it")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the directory of {value!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into the directory of {value!r}")
    return value


def _image(value: str) -> str:
    try:
        import matplotlib.backend_bases
    except ImportError:
        raise argparse.ArgumentTypeError(
            f"{value!r} needs matplotlib; install it with pip install 'prefetchx[plot]'"
        ) from None
    formats = matplotlib.backend_bases.FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(value)[1][1:].lower()
    if suffix and suffix not in formats:
        raise argparse.ArgumentTypeError(
            f"{value!r} names no image format matplotlib writes; use one of "
            f"{', '.join(sorted('.' + f for f in formats))}, or none for PNG"
        )
    return _output(value)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` command to the ``prefetchx`` command's subcommands."""
    what = "measure what prefetching saves on this machine"
    bench = commands.add_parser(
        "bench",
        help=what,
        description=(
            f"{what.capitalize()}: a synthetic loop with three kinds of work against a plain "
            "DataLoader and the BackgroundGenerator recipe, a JPEG-decoding CPU workload, and, "
            "where CUDA is present, copy bandwidth and an end-to-end GPU step."
        ),
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a short run: three synthetic cases with short epochs, and no JPEG workload (the "
        "CUDA part, where there is one, runs in full)",
    )
    bench.add_argument(
        "--max-prefetch",
        type=depth,
        default=2,
        metavar="N",
        help="queue depth of the prefetching threads, >= 1 (default: 2)",
    )
    bench.add_argument("--cpu-only", action="store_true", help="skip the CUDA benchmarks")
    bench.add_argument(
        "--json", type=_output, metavar="PATH", help="also write the results as JSON"
    )
    bench.add_argument(
        "--plot",
        type=_image,
        metavar="PATH",
        help="also draw the speedups as an image, PNG unless the suffix names another "
        "format (needs matplotlib: pip install 'prefetchx[plot]')",
    )
    bench.set_defaults(run=_bench)
