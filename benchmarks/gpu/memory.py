"""#15 run 5: device and pinned host memory over 20 epochs, and after a break (GPU only).

    python benchmarks/gpu/memory.py

Reserved and allocated device memory after each epoch, and the caching host allocator's pinned
bytes (current/peak/reserved), for a loader with 4 persistent workers and device_prefetch=2 over
uint8 3x224x224 batches of 64; then after a ``break`` and after ``close()``.
"""

import gc

import torch

from prefetchx import DataLoaderX
from prefetchx.bench.cuda import MEAN, STD, _Images

ds = _Images(16 * 64)
loader = DataLoaderX(
    ds,
    batch_size=64,
    device="cuda",
    mean=MEAN,
    std=STD,
    num_workers=4,
    persistent_workers=True,
    device_prefetch=2,
)


def host() -> str:
    try:
        s = torch.cuda.host_memory_stats()
        parts = (s["allocated_bytes.current"], s["allocated_bytes.peak"])
        parts += (s.get("reserved_bytes.current", 0),)
        return "/".join(f"{b / 2**20:.1f}" for b in parts)
    except Exception as e:
        return f"n/a ({type(e).__name__})"


print("epoch reserved_MiB allocated_MiB host_pinned_MiB(current/peak/reserved)")
for epoch in range(20):
    for x, _y in loader:
        z = x.sum()
    torch.cuda.synchronize()
    print(
        epoch,
        torch.cuda.memory_reserved() // 2**20,
        torch.cuda.memory_allocated() // 2**20,
        host(),
        flush=True,
    )
for _x, _y in loader:
    break
del x, _x, _y, z  # x: the last epoch's last batch, one float32 batch of 36.75 MiB
gc.collect()
torch.cuda.synchronize()
print("after break:", torch.cuda.memory_allocated() // 2**20, "MiB allocated,", host(), "MiB host")
loader.close()
gc.collect()
torch.cuda.synchronize()
print("after close:", torch.cuda.memory_allocated() // 2**20, "MiB allocated")
print("host stats keys:", sorted(torch.cuda.host_memory_stats()))
