"""The end-to-end step as paired ratios: is DataLoaderX behind apex-style, and by how much?

    PYTHONPATH=<package to measure> python benchmarks/gpu/step_paired.py [--rounds N]

`prefetchx.bench.cuda.measure_step` gives each arm's median epoch over 5 rounds, unpaired: on
the H200 at 838aba6 and 1abc908 DataLoaderX read 1.0% and 1.3% behind apex-style there, which 5
unpaired medians cannot tell from noise. This script runs the same step (the same dataset,
workers, model and arms: that function) with more rounds, every arm once a round in a rotated
order, and prints each arm's epoch over apex-style's within the round: the median and the
lowest and highest round. More DataLoaderX arms say where a cost would come from: without
the thread stage (`max_prefetch=0`: the device stage alone), the same with `pin_memory=True`
(DataLoader's pin thread pins, as the docs advise when the thread is off) and with
`device_prefetch=2`. GPU only.
"""

from __future__ import annotations

import argparse
import statistics

from prefetchx.bench.cuda import measure_step

VARIANTS = {
    "prefetchx mp0": {"max_prefetch": 0},
    "prefetchx mp0 pin": {"max_prefetch": 0, "pin_memory": True},
    "prefetchx dp2": {"device_prefetch": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--channels", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    shape = {"batches": 24, "batch_size": 64, "num_workers": 4}  # the bench's
    for channels in args.channels:
        steps = measure_step(channels=channels, rounds=args.rounds, variants=VARIANTS, **shape)
        rounds = {s.arm: s.rounds_s for s in steps}
        print(
            f"== channels={channels}, {shape['batches']} batches of {shape['batch_size']}, "
            f"{shape['num_workers']} workers, {args.rounds} rounds"
        )
        print(f"{'arm':>17} {'epoch ms':>9}  {'/ apex-style, paired':>22}  {'/ data-on-gpu':>13}")
        for s in steps:
            vs_apex = [a / b for a, b in zip(s.rounds_s, rounds["apex-style"], strict=True)]
            print(
                f"{s.arm:>17} {s.epoch_s * 1e3:9.1f}  "
                f"{statistics.median(vs_apex):6.3f} ({min(vs_apex):.3f}-{max(vs_apex):.3f})  "
                f"{s.vs_bound:13.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
