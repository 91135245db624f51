"""What the benchmark programs share: their common options, and how they record a run, a text
table and a JSON record that both name the machine, the versions and the commit
(`prefetchx.bench.synthetic.machine_meta`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefetchx.bench.paired import MIN_ROUNDS
from prefetchx.bench.synthetic import ARM_NOTES, wrap


def meta_line(meta: Mapping[str, Any]) -> str:
    """The first line of a recorded table: versions, machine, CPUs, commit."""
    gpu = f", {meta['gpu']}" if meta.get("gpu") else ""
    return (
        f"prefetchx {meta['prefetchx']}, torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['machine']}, {meta['cpus']} CPUs{gpu}, commit {meta['commit']}"
    )


def add_options(parser: argparse.ArgumentParser, example: str) -> None:
    """Add ``--rounds``, ``--max-prefetch`` and ``--out`` (``example``: a stem to show)."""
    parser.add_argument(
        "--rounds",
        type=rounds,
        default=MIN_ROUNDS,
        metavar="N",
        help=f"paired rounds, >= {MIN_ROUNDS} (default {MIN_ROUNDS})",
    )
    parser.add_argument(
        "--max-prefetch",
        type=depth,
        default=2,
        metavar="N",
        help="queue depth of the prefetching arms, >= 1 (default 2)",
    )
    parser.add_argument(
        "--out",
        type=out_stem,
        metavar="STEM",
        help=f"write STEM.txt and STEM.json, e.g. {example}",
    )


def depth(value: str) -> int:
    """An argparse type for ``--max-prefetch``: a queue depth of 1 or more."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if count == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0 (no thread: nothing to measure)")
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
    return count


def integer_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``, refused with the value otherwise."""

    def parse(value: str) -> int:
        try:
            count = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {least}, got {value!r}"
            ) from None
        if count < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {count}")
        return count

    return parse


rounds = integer_at_least(MIN_ROUNDS)
"""An argparse type for ``--rounds``: at least `MIN_ROUNDS`."""


def out_stem(value: str) -> str:
    """An argparse type for ``--out STEM``: the run goes to ``STEM.txt`` and ``STEM.json``."""
    folder = os.path.dirname(value) or "."
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a directory; give a file name in it without suffix, such as "
            f"{os.path.join(value, 'grid-cpu-2core')!r}"
        )
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the directory of {value!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into the directory of {value!r}")
    return value


def report(
    out: str | None,
    meta: Mapping[str, Any],
    sections: Sequence[str],
    conclusion: str,
    columns: Mapping[str, str],
    arms: Iterable[str],
    **entries: Any,
) -> None:
    """Print a run's ``sections`` and last its ``conclusion``, and with ``out`` (a stem) save
    them (`save`), the conclusion and ``entries`` in the record."""
    body = "\n\n".join([*sections, wrap(conclusion, indent="")])
    print(f"\n{body}", flush=True)
    if out:
        written = save(out, meta, body, columns, arms, conclusion=conclusion, **entries)
        print("wrote " + " and ".join(map(str, written)), file=sys.stderr)


def save(
    stem: str,
    meta: Mapping[str, Any],
    body: str,
    columns: Mapping[str, str],
    arms: Iterable[str],
    **entries: Any,
) -> list[Path]:
    """Write ``STEM.txt``: the meta line (`meta_line`) and ``body``; and ``STEM.json``:
    ``meta``, what the ``columns`` and ``arms`` are, and ``entries``. Returns the paths."""
    txt, js = Path(f"{stem}.txt"), Path(f"{stem}.json")
    txt.write_text(f"{meta_line(meta)}\n\n{body.rstrip()}\n")
    record = {
        "meta": meta,
        "columns": columns,
        "arms": {arm: ARM_NOTES[arm] for arm in arms},
        **entries,
    }
    js.write_text(json.dumps(record, indent=2) + "\n")
    return [txt, js]
