"""The ``prefetchx`` command, also run as ``python -m prefetchx``."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from prefetchx import __version__
from prefetchx.bench import cli as bench


def main(argv: list[str] | None = None) -> int:
    """Run the ``prefetchx`` command with ``argv`` (default: the process's arguments).

    Returns:
        The exit status. A bad argument exits with status 2 and a usage message instead.
    """
    parser = argparse.ArgumentParser(
        prog="prefetchx",
        description="prefetchx, a drop-in PyTorch DataLoader that prefetches batches.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"prefetchx {__version__} (torch {torch.__version__}, "
        f"Python {platform.python_version()})",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench.add_parser(commands)
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
