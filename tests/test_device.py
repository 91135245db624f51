"""Resolving the target device: errors name the device, nothing is guessed."""

from __future__ import annotations

import pytest
import torch

from prefetchx._device import resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@no_cuda
def test_none_without_an_accelerator_is_the_cpu() -> None:
    if getattr(torch, "accelerator", None) is not None and torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    assert resolve_device(None) == torch.device("cpu")


@no_cuda
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
