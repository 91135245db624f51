"""Resolving the target device: errors name the device, nothing is guessed."""

from __future__ import annotations

import re
import threading
import warnings
from typing import Any

import pytest
import torch

from prefetchx import DataLoaderX, Prefetcher, ThreadStage
from prefetchx._options import PrefetchOptions
from prefetchx._pipeline import Pipeline
from tests.helpers import repo_env, run_python


def resolve_device(device: Any) -> torch.device:
    """The device a loader built with ``device`` sends batches to: checked when it is built,
    completed with the current index at its first ``iter()``."""
    return Pipeline(PrefetchOptions(device=device)).target


def test_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_none_without_an_accelerator_is_the_cpu() -> None:
    # Outside `cuda`-marked tests this machine has no accelerator (see conftest.py).
    assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_cuda_is_refused(device: object) -> None:
    with pytest.raises(ValueError, match=r"CUDA is not available"):
        resolve_device(device)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_index_is_made_explicit_and_checked() -> None:
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"`device` 'cuda:{count}' does not exist"):
        resolve_device(f"cuda:{count}")


@pytest.mark.parametrize(
    ("device", "exc", "pattern"),
    [
        ("gpu7", ValueError, r"`device` 'gpu7' is not a device"),
        (1.5, TypeError, r"`device` must be a string.*1\.5 \(float\)"),
        (True, TypeError, r"`device` must be a string"),
        ("meta", ValueError, r"`device` 'meta' is not available"),
    ],
)
def test_bad_devices(device: object, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        resolve_device(device)  # type: ignore[arg-type]


class _FakeGpus:
    """``count`` CUDA devices as `torch.cuda` reports them, with a current device per process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.current = 0
        self.set_in: list[tuple[str, torch.device]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        if getattr(torch, "accelerator", None) is not None:  # torch >= 2.6
            monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
            monkeypatch.setattr(
                torch.accelerator, "current_accelerator", lambda *_: torch.device("cuda")
            )

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else device.index
        assert index is not None
        self.set_in.append((threading.current_thread().name, torch.device("cuda", index)))
        self.current = index


def test_a_ranks_default_device_is_the_one_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # FIELD pitfall 5: a DDP rank calls torch.cuda.set_device(local_rank), then builds its loader
    # with device=None; the loader and its thread must use that GPU, not GPU 0.
    gpus = _FakeGpus(monkeypatch, count=4)
    torch.cuda.set_device(2)
    assert resolve_device(None) == torch.device("cuda", 2)
    assert resolve_device("cuda") == torch.device("cuda", 2)
    assert resolve_device("cuda:3") == torch.device("cuda", 3)
    gpus.set_in.clear()
    with ThreadStage(iter(range(3)), device=resolve_device(None)) as stage:
        assert list(stage) == [0, 1, 2]
    assert gpus.set_in == [("prefetchx-thread", torch.device("cuda", 2))]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_default_device_follows_set_device_on_a_real_gpu() -> None:
    last = torch.cuda.device_count() - 1
    before = torch.cuda.current_device()
    torch.cuda.set_device(last)
    try:
        assert resolve_device(None) == torch.device("cuda", last)
        loader = DataLoaderX(torch.arange(8.0), batch_size=4)
        assert [batch.device for batch in loader] == [torch.device("cuda", last)] * 2
    finally:
        torch.cuda.set_device(before)


has_accelerator_api = pytest.mark.skipif(
    getattr(torch, "accelerator", None) is None, reason="torch.accelerator needs torch >= 2.6"
)


class _FakeAccelerator:
    """``count`` devices of ``kind`` as `torch.accelerator` reports them (not CUDA, not MPS)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kind: str, count: int) -> None:
        self.current = 0
        self.set_in: list[tuple[str, int]] = []
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_: torch.device(kind))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: self.current)
        monkeypatch.setattr(torch.accelerator, "set_device_index", self.set_device_index)

    def set_device_index(self, index: int) -> None:
        self.set_in.append((threading.current_thread().name, index))
        self.current = index


@has_accelerator_api
def test_another_accelerator_is_resolved_checked_and_set_in_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    xpus = _FakeAccelerator(monkeypatch, "xpu", count=2)
    torch.accelerator.set_device_index(1)
    assert resolve_device(None) == torch.device("xpu", 1)
    assert resolve_device("xpu") == torch.device("xpu", 1)
    assert resolve_device("xpu:0") == torch.device("xpu", 0)
    with pytest.raises(ValueError, match=r"`device` 'xpu:2' does not exist: .* 2 xpu device"):
        resolve_device("xpu:2")
    with pytest.raises(ValueError, match=r"`device` 'hpu' is not available: .* here is xpu"):
        resolve_device("hpu")
    with pytest.raises(ValueError, match=r"CUDA is not available"):
        resolve_device("cuda")
    xpus.set_in.clear()
    with ThreadStage(iter(range(3)), device=resolve_device(None)) as stage:
        assert list(stage) == [0, 1, 2]
    assert xpus.set_in == [("prefetchx-thread", 1)]


def test_without_an_accelerator_another_kind_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`device` 'xpu' is not available: .* here is none"):
        resolve_device("xpu")


def test_mps_is_resolved_and_copied_to_without_streams_or_pinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FIELD pitfall 6: non_blocking copies to MPS have corrupted data, so they block there.
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    if getattr(torch, "accelerator", None) is not None:
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda *_: torch.device("mps")
        )
        assert resolve_device(None) == torch.device("mps", 0)
    assert resolve_device("mps") == torch.device("mps", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pin_memory warning: pinning is for CUDA
        loader = DataLoaderX(torch.arange(8.0), batch_size=4, device="mps", pin_memory=False)
    assert loader.device == "mps"
    assert not loader.pin_memory
    assert loader._pipeline._side_streams() is None


# --- no CUDA initialization when a loader is built (FIELD pitfall 22, #13 defect 4) ----------


class _Tripwire:
    """Makes ``names`` of ``module`` raise while armed: calls that initialize CUDA (or another
    accelerator), which fork-based launchers (Lightning's ``ddp_fork``) refuse to follow.

    Disarmed, each name does what it did before (the fake's or torch's own); a side stream made
    then is a stand-in that records its device in ``streams``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, names: list[str]) -> None:
        self.armed = True
        self.tripped: list[str] = []  # the calls made while armed, however they were handled
        self.streams: list[torch.device] = []
        if module is torch.cuda and "Stream" in names:
            monkeypatch.setattr(torch.cuda, "Stream", self._stream)
        for name in names:
            monkeypatch.setattr(module, name, self._guard(module, name, getattr(module, name)))

    def _guard(self, module: Any, name: str, original: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.tripped.append(name)
                raise AssertionError(f"{module.__name__}.{name} initializes the device")
            return original(*args, **kwargs)

        return guarded

    def _stream(self, device: Any = None, **kwargs: Any) -> object:
        self.streams.append(torch.device(device))
        return object()


_CUDA_INIT = ["current_device", "_lazy_init", "init", "set_device", "Stream", "current_stream"]
_ACCELERATOR_INIT = ["current_device_index", "set_device_index"]


def _cuda_tripwires(monkeypatch: pytest.MonkeyPatch) -> list[_Tripwire]:
    wires = [_Tripwire(monkeypatch, torch.cuda, _CUDA_INIT)]
    if getattr(torch, "accelerator", None) is not None:  # its index also initializes CUDA
        wires.append(_Tripwire(monkeypatch, torch.accelerator, _ACCELERATOR_INIT))
    return wires


def _disarm(wires: list[_Tripwire]) -> None:
    for wire in wires:
        wire.armed = False


@pytest.mark.parametrize(
    "device", [None, "cuda", torch.device("cuda"), "cuda:1"], ids=["None", "cuda", "dev", "cuda:1"]
)
@pytest.mark.parametrize("make", [DataLoaderX, Prefetcher])
def test_building_a_loader_does_not_initialize_cuda(
    monkeypatch: pytest.MonkeyPatch, make: Any, device: object
) -> None:
    _FakeGpus(monkeypatch, count=2)
    wires = _cuda_tripwires(monkeypatch)
    if make is Prefetcher:
        Prefetcher(torch.arange(8.0).split(4), device=device)
    else:
        DataLoaderX(torch.arange(8.0), batch_size=4, device=device)
    assert [wire.tripped for wire in wires] == [[]] * len(wires)


@pytest.mark.parametrize("device", ["cuda:2", torch.device("cuda", 2)])
def test_a_cuda_index_past_the_last_is_refused_when_the_loader_is_built(
    monkeypatch: pytest.MonkeyPatch, device: object
) -> None:
    _FakeGpus(monkeypatch, count=2)
    _cuda_tripwires(monkeypatch)
    shown = re.escape(repr(device))
    with pytest.raises(ValueError, match=rf"`device` {shown} does not exist: .* 2 CUDA device"):
        DataLoaderX(torch.arange(8.0), batch_size=4, device=device)


@pytest.mark.parametrize("device", [None, "cuda"])
def test_the_first_iter_takes_the_current_cuda_device_then_keeps_it(
    monkeypatch: pytest.MonkeyPatch, device: str | None
) -> None:
    gpus = _FakeGpus(monkeypatch, count=2)
    wires = _cuda_tripwires(monkeypatch)
    loader = DataLoaderX(torch.arange(8.0), batch_size=4, device=device)
    _disarm(wires)
    torch.cuda.set_device(1)  # after the loader is built: a rank picking its GPU, say
    with iter(loader):
        assert loader._pipeline.target == torch.device("cuda", 1)
    gpus.current = 0
    with iter(loader):  # the side stream is made for one device, once: the device stays
        assert loader._pipeline.target == torch.device("cuda", 1)
    assert wires[0].streams == [torch.device("cuda", 1)]


@has_accelerator_api
def test_another_accelerator_is_checked_when_built_and_indexed_at_the_first_iter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    xpus = _FakeAccelerator(monkeypatch, "xpu", count=2)
    wire = _Tripwire(monkeypatch, torch.accelerator, _ACCELERATOR_INIT)
    loaders = [DataLoaderX(torch.arange(8.0), batch_size=4, device=d) for d in (None, "xpu")]
    pinned = DataLoaderX(torch.arange(8.0), batch_size=4, device="xpu:0")
    with pytest.raises(ValueError, match=r"`device` 'xpu:2' does not exist: .* 2 xpu device"):
        DataLoaderX(torch.arange(8.0), batch_size=4, device="xpu:2")
    wire.armed = False
    for current in (1, 0):  # the first iter() takes the current device, later ones keep it
        xpus.current = current
        for loader in [*loaders, pinned]:
            with iter(loader):
                pass
        assert [loader._pipeline.target for loader in loaders] == [torch.device("xpu", 1)] * 2
        assert pinned._pipeline.target == torch.device("xpu", 0)


def test_cuda_is_looked_for_through_torch_cuda_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.is_available() can count through NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1, which
    # Lightning sets); torch.accelerator's first versions count through the CUDA runtime, which
    # initializes the driver before a fork-based launcher forks.
    _FakeGpus(monkeypatch, count=2)
    if getattr(torch, "accelerator", None) is not None:
        _Tripwire(monkeypatch, torch.accelerator, ["is_available", "device_count"])
    assert DataLoaderX(range(8), batch_size=4)._pipeline.device == torch.device("cuda")


_FORK_AFTER_BUILDING = """
import multiprocessing
import torch
from prefetchx import DataLoaderX


def child(queue):
    queue.put(torch.ones(4, device="cuda").sum().item())


loaders = [DataLoaderX(torch.arange(8.0), batch_size=4, device=d) for d in (None, "cuda", "cuda:0")]
assert not torch.cuda.is_initialized(), "building a loader initialized CUDA"
fork = multiprocessing.get_context("fork")
queue = fork.Queue()
process = fork.Process(target=child, args=(queue,))
process.start()
process.join(60)
assert process.exitcode == 0, f"the forked child could not use CUDA: {process.exitcode}"
assert queue.get(timeout=10) == 4.0
last = torch.cuda.device_count() - 1
torch.cuda.set_device(last)
assert [x.device.index for x in loaders[0]] == [last, last]
print("ok")
"""


@pytest.mark.cuda
def test_a_process_that_built_loaders_can_still_fork_cuda_children() -> None:
    # Lightning's ddp_fork and notebooks fork after the loaders are built; Lightning sets
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 so that torch.cuda.is_available() asks NVML.
    env = repo_env(PYTORCH_NVML_BASED_CUDA_CHECK="1")
    env.pop("TORCH_CUDA_SANITIZER", None)  # about initialization, not races: no sanitizer
    done = run_python(_FORK_AFTER_BUILDING, env, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
