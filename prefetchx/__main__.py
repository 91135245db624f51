"""``python -m prefetchx``: the ``prefetchx`` command (see `prefetchx.bench.cli`)."""

from __future__ import annotations

import sys

from prefetchx.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
