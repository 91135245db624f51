"""#15 runs 4 and 6: a compute-bound step, DataLoaderX's options, and the device stage's ops.

    python benchmarks/gpu/step_options.py

1. `prefetchx.bench.cuda.measure_step` with 256 channels, so that the step, not the 4 workers,
   sets the pace: every arm against the bound with data already on the GPU.
2. DataLoaderX's options on the 128-channel step (device_prefetch 0/1/2/4, channels_last with a
   channels_last model, float16/bfloat16 output under autocast, pageable host memory), each
   against the data-on-GPU bound; arms interleaved over 5 rounds, medians.
3. What each CUDA call the device stage makes costs the host, in us per call. GPU only.
"""

import statistics
import time

import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX
from prefetchx.bench.cuda import MEAN, STD, _events_time, _Images, _model, measure_step

dev = torch.device("cuda", 0)
print("== measure_step, channels=256 (compute-bound?) ==", flush=True)
for s in measure_step(channels=256, rounds=5):
    print(f"{s.arm:>12} {s.epoch_s * 1e3:9.1f} {s.vs_bound:7.3f}x", flush=True)

print(
    "\n== DataLoaderX options on the same step (channels=128, 24 batches of 64, 4 workers) ==",
    flush=True,
)
ds = _Images(24 * 64)
kw = dict(batch_size=64, num_workers=4, persistent_workers=True)


def run(loader, model, opt, dtype=None):
    def f():
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

    return f


variants = {
    "dp0": dict(device_prefetch=0),
    "dp1": dict(device_prefetch=1),
    "dp2": dict(device_prefetch=2),
    "dp4": dict(device_prefetch=4),
    "channels_last": dict(channels_last=True),
    "fp16": dict(dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16),
    "pageable": dict(pin_memory=False),
}
arms = {}
for name, v in variants.items():
    m = _model(dev, 128)
    if name == "channels_last":
        m = m.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    loader = DataLoaderX(ds, device=dev, mean=MEAN, std=STD, **kw, **v)
    arms[name] = run(loader, m, opt, v.get("dtype"))
mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1)
std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)
on_gpu = [((x.to(dev).float() - mean) / std, y.to(dev)) for x, y in DataLoader(ds, batch_size=64)]
m = _model(dev, 128)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
arms["data-on-gpu"] = run(on_gpu, m, opt)
for f in arms.values():
    f()
times = {k: [] for k in arms}
names = list(arms)
for r in range(5):
    for k in names[r % len(names) :] + names[: r % len(names)]:
        torch.cuda.synchronize()
        times[k].append(_events_time(arms[k]))
b = statistics.median(times["data-on-gpu"])
for k, t in times.items():
    print(
        f"{k:>14} {statistics.median(t) * 1e3:9.1f} ms {statistics.median(t) / b:7.3f}x", flush=True
    )
print("reserved MiB after:", torch.cuda.memory_reserved() // 2**20)

print("\n== device-stage ops, us per call (10000 calls) ==", flush=True)
s = torch.cuda.Stream()
t = torch.zeros(32, 16).pin_memory()
g = torch.zeros(32, 16, device=dev)
e = torch.cuda.Event()
ops = {
    "current_stream()": lambda: torch.cuda.current_stream(),
    "current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "Event()": lambda: torch.cuda.Event(),
    "event.record(s)": lambda: e.record(s),
    "s.wait_event(e)": lambda: s.wait_event(e),
    "e.query()": lambda: e.query(),
    "with stream(s)": lambda: torch.cuda.stream(s).__enter__() and None,
    "g.record_stream(s)": lambda: g.record_stream(s),
    "t.to(dev, nb)": lambda: t.to(dev, non_blocking=True),
    "t.is_pinned()": lambda: t.is_pinned(),
    "t.pin_memory()": lambda: torch.zeros(32, 16).pin_memory(),
}
for name, op in ops.items():
    cur = torch.cuda.current_stream()
    for _ in range(100):
        op()
    t0 = time.perf_counter()
    for _ in range(10000):
        op()
    dt = (time.perf_counter() - t0) / 10000 * 1e6
    torch.cuda.set_stream(cur)
    torch.cuda.synchronize()
    print(f"{name:>22}: {dt:6.2f}", flush=True)
