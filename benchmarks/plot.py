"""Draw a recorded bench run again, from the JSON that ``prefetchx bench --json`` wrote.

No benchmark runs: the picture follows changes to the drawing (`prefetchx.bench.plot`), the
figures stay those of the recorded run, and its title names that run's versions and commit.
The plot on the documentation site and beside the recorded run is drawn so::

    python benchmarks/plot.py benchmarks/results/bench-cpu-2core.json \\
        benchmarks/results/bench-cpu-2core.png docs/assets/bench-cpu-2core.png
"""

from __future__ import annotations

import argparse
import json
import sys

from prefetchx.bench import plot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="the JSON of a bench run")
    parser.add_argument("images", nargs="+", help="image files to draw (PNG, SVG, ...)")
    args = parser.parse_args(argv)
    with open(args.record) as f:
        run = json.load(f)
    for path in args.images:
        plot.save(run, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
