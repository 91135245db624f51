"""Resolving the target device: errors name the device, nothing is guessed."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from prefetchx import DataLoaderX, ThreadStage
from prefetchx._device import resolve_device


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
