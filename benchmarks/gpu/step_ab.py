"""The end-to-end step at 64 and 256 channels, every arm against the data-on-GPU bound.

    PYTHONPATH=<package to measure> python benchmarks/gpu/step_ab.py

`prefetchx.bench.cuda.measure_step`, 5 rounds each: run it over two packages (an A/B of a change
to the device path) in one device call. GPU only.
"""

from prefetchx.bench.cuda import measure_step

for channels in (64, 256):
    print(f"== measure_step channels={channels}", flush=True)
    for s in measure_step(channels=channels, rounds=5):
        print(f"{s.arm:>12} {s.epoch_s * 1e3:9.1f} {s.vs_bound:7.3f}x", flush=True)
