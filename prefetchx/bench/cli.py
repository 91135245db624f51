"""The ``bench`` command: ``python -m prefetchx bench`` (or ``prefetchx bench``).

Measures what prefetching saves on this machine: a synthetic loop with three kinds of work, a
JPEG-decoding CPU workload, and, where CUDA is present, copy bandwidth and an end-to-end GPU step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from prefetchx import __version__
from prefetchx.bench.synthetic import ArmResult, Case, as_rows, format_table, machine_meta, measure

DEFAULT_GRID = [
    Case("sleep", 5, 5, 50, rounds=5),  # the overlap-efficiency target
    Case("sleep", 10, 5, 30),
    Case("numpy", 5, 5, 40),
    Case("python", 5, 5, 40),  # the control: the GIL leaves nothing to overlap
    # No step work: long epochs, as each batch costs only microseconds, and the recipe apart,
    # as it is 5-10x slower there.
    Case("sleep", 0, 0, 20000, rounds=7, arms=("plain", "prefetchx")),  # the >= 0.9x target
    Case("sleep", 0, 0, 2000),
]
QUICK_GRID = [
    Case("sleep", 5, 5, 30),
    Case("python", 2, 2, 30, rounds=1),
    Case("sleep", 0, 0, 10000, rounds=5, arms=("plain", "prefetchx")),
]


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    return {**machine_meta(), "max_prefetch": args.max_prefetch, "quick": args.quick}


def _synthetic(args: argparse.Namespace) -> list[ArmResult]:
    print("\n== Synthetic loop: per-batch data and step cost; arms interleaved; medians ==")
    results: list[ArmResult] = []
    for case in QUICK_GRID if args.quick else DEFAULT_GRID:
        results.extend(measure(case, max_prefetch=args.max_prefetch, progress=_log))
    print(format_table(results), flush=True)
    return results


def _jpeg() -> list[dict[str, Any]]:
    print("\n== JPEG decode + small conv net step on the CPU (96 images, batch 16) ==")
    try:
        import PIL  # noqa: F401
    except ImportError:
        print("skipped: needs pillow (pip install pillow)")
        return []
    from prefetchx.bench.jpeg import measure_jpeg

    rows = []
    default_threads = torch.get_num_threads()
    print(
        f"{'threads':>8} {'workers':>8} {'plain ms':>9} {'prefetchx ms':>13} {'speedup':>8}  "
        "prefetchx stall meter"
    )
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        try:
            for workers in (0, 2):
                r = measure_jpeg(workers, images=96, progress=_log)
                print(
                    f"{threads:>8} {workers:>8} {r.plain_s * 1e3:>9.1f} "
                    f"{r.prefetchx_s * 1e3:>13.1f} {r.speedup:>7.2f}x  {r.verdict}",
                    flush=True,
                )
                rows.append({"torch_threads": threads, **asdict(r)})
        finally:
            torch.set_num_threads(default_threads)
    return rows


def _cuda() -> dict[str, Any]:
    from prefetchx.bench.cuda import report

    return report()


def _bench(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    meta = _meta(args)
    print(
        f"prefetchx {__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, commit {meta['commit']}"
    )
    synthetic = _synthetic(args)
    jpeg = [] if args.quick else _jpeg()
    cuda = _cuda() if torch.cuda.is_available() and not args.cpu_only else {}
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
    record = {"meta": meta, "results": as_rows(synthetic), "jpeg": jpeg, "cuda": cuda}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from prefetchx.bench import plot

        plot.save(record, args.plot)
        print(f"wrote {args.plot}")
    return 0


# Each check runs while the arguments are parsed, so a bad value is a usage error naming the
# option and the value before the bench starts, not a traceback after it.


def _depth(value: str) -> int:
    try:
        depth = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if depth == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0 (no thread: nothing to measure)")
    if depth < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {depth}")
    return depth


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
        help="a short run: three synthetic cases with fewer batches and rounds, and no JPEG "
        "workload (the CUDA part, where there is one, runs in full)",
    )
    bench.add_argument(
        "--max-prefetch",
        type=_depth,
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
