"""DataLoaderX's device-stage arguments on a machine without an accelerator (the CPU path)."""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX
from prefetchx._loader import _refuses_pinning
from prefetchx._normalize import Normalize

MEAN, STD = (10.0, 20.0, 30.0), (2.0, 4.0, 8.0)


class Images(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "image": torch.full((3, 2, 2), 10 * i, dtype=torch.uint8),
            "label": i,
            "name": f"img{i}",
        }


def _expected(images: torch.Tensor) -> torch.Tensor:
    return (images.float() - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1
    )


@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_normalizes_the_input_on_the_cpu(max_prefetch: int) -> None:
    plain = list(DataLoader(Images(), batch_size=3))
    ours = list(
        DataLoaderX(
            Images(),
            batch_size=3,
            mean=MEAN,
            std=STD,
            dtype=torch.bfloat16,
            channels_last=True,
            input_key="image",
            max_prefetch=max_prefetch,
        )
    )
    assert len(ours) == 2
    for got, want in zip(ours, plain, strict=True):
        assert got["image"].dtype == torch.bfloat16
        assert got["image"].is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(
            got["image"], _expected(want["image"]).bfloat16(), rtol=0, atol=0
        )
        assert torch.equal(got["label"], want["label"])  # other leaves keep their dtype
        assert got["name"] == want["name"]


def test_cpu_normalization_runs_in_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    original = Normalize.__call__

    def spy(self: Normalize, x: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return original(self, x)

    monkeypatch.setattr(Normalize, "__call__", spy)
    loader = DataLoaderX(
        Images(), batch_size=2, mean=MEAN, std=STD, input_key="image", device="cpu", max_prefetch=4
    )
    for _ in loader:
        time.sleep(0.002)  # a step: the thread stays on
    # The first batch of an epoch is made in the caller's thread, every later one in the thread.
    assert threads == [threading.current_thread().name] + ["prefetchx-thread"] * 2


def test_without_normalization_batches_equal_dataloader() -> None:
    plain = list(DataLoader(Images(), batch_size=4))
    ours = list(DataLoaderX(Images(), batch_size=4, device="cpu"))
    for got, want in zip(ours, plain, strict=True):
        assert torch.equal(got["image"], want["image"])
        assert got["image"].dtype == torch.uint8


def test_channel_mismatch_raises_at_the_first_batch() -> None:
    loader = DataLoaderX(
        Images(), batch_size=3, mean=(1.0,), std=(1.0,), input_key="image", device="cpu"
    )
    with pytest.raises(ValueError, match=r"1 channels but the input has 3"):
        next(iter(loader))


def test_every_argument_is_a_same_named_attribute_and_in_the_signature() -> None:
    kwargs: dict[str, Any] = {
        "max_prefetch": 3,
        "device": "cpu",
        "mean": MEAN,
        "std": STD,
        "dtype": torch.float16,
        "channels_last": True,
        "input_key": "image",
        "device_prefetch": 2,
        "non_blocking": False,
    }
    loader = DataLoaderX(Images(), batch_size=3, **kwargs)
    params = inspect.signature(DataLoaderX).parameters
    for name, value in kwargs.items():
        assert getattr(loader, name) == value
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    # A framework can rebuild the loader from the attributes.
    rebuilt = DataLoaderX(
        loader.dataset, batch_size=3, **{name: getattr(loader, name) for name in kwargs}
    )
    assert rebuilt.mean == MEAN


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"device": "cuda:7"}, ValueError, r"`device` 'cuda:7'"),
        ({"device": "tpu"}, ValueError, r"`device` 'tpu'"),
        ({"mean": MEAN}, ValueError, r"`mean` was given without `std`"),
        ({"dtype": torch.int64}, ValueError, r"`dtype` must be a floating dtype"),
        ({"device_prefetch": -1}, ValueError, r"`device_prefetch` must be >= 0, got -1"),
        ({"device_prefetch": 1.0}, TypeError, r"`device_prefetch` must be an int"),
        ({"non_blocking": "yes"}, TypeError, r"`non_blocking` must be a bool, got 'yes'"),
        ({"input_key": 1.5}, TypeError, r"`input_key` must be an int index or a str key, got 1\.5"),
        ({"channels_last": "no"}, TypeError, r"`channels_last` must be a bool"),
    ],
)
def test_bad_arguments_raise_at_construction(
    kwargs: dict[str, Any], exc: type[Exception], pattern: str
) -> None:
    with pytest.raises(exc, match=pattern):
        DataLoaderX(Images(), **kwargs)


def test_pin_memory_keeps_dataloaders_default_and_an_explicit_false_warns_once() -> None:
    # The thread stage pins for a CUDA target; DataLoader's pinning would fail on a dataset that
    # returns CUDA tensors, which DataLoader itself accepts.
    dataset = Images()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _refuses_pinning(dataset, (), {})
        assert not _refuses_pinning(dataset, (), {"pin_memory": True})
    with pytest.warns(UserWarning, match=r"pin_memory=False.*synchronous.*Leave pin_memory unset"):
        assert _refuses_pinning(dataset, (1, False, None, None, 0, None, False), {})
