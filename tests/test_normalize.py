"""Normalize: values against a reference computed here, dtypes, memory format, errors."""

from __future__ import annotations

import math

import pytest
import torch

from prefetchx._normalize import Normalize

MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def _images(n: int = 2, c: int = 3, h: int = 5, w: int = 4) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, c, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )


def _reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    work = torch.float64 if dtype == torch.float64 else torch.float32
    mean = torch.tensor(MEAN, dtype=work).view(1, -1, 1, 1)
    std = torch.tensor(STD, dtype=work).view(1, -1, 1, 1)
    return ((x.to(work) - mean) / std).to(dtype)


@pytest.mark.parametrize(
    "dtype", [None, torch.float32, torch.float16, torch.bfloat16, torch.float64]
)
def test_values_match_the_reference(dtype: torch.dtype | None) -> None:
    x = _images()
    out = Normalize(MEAN, STD, dtype)(x)
    expected_dtype = torch.float32 if dtype is None else dtype
    assert out.dtype == expected_dtype
    torch.testing.assert_close(out, _reference(x, expected_dtype), rtol=0, atol=0)


def test_input_is_not_modified() -> None:
    x = _images().float()
    before = x.clone()
    Normalize(MEAN, STD)(x)
    assert torch.equal(x, before)


def test_dtype_alone_casts() -> None:
    out = Normalize(dtype=torch.float16)(_images())
    assert out.dtype == torch.float16
    assert torch.equal(out, _images().half())


def test_channels_last_alone_keeps_values_and_dtype() -> None:
    out = Normalize(channels_last=True)(_images())
    assert out.dtype == torch.uint8
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, _images())


def test_channels_last_with_normalization() -> None:
    out = Normalize(MEAN, STD, torch.bfloat16, channels_last=True)(_images())
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, _reference(_images(), torch.bfloat16), rtol=0, atol=0)


def test_other_ranks_normalize_on_dim_1() -> None:
    x = torch.arange(12, dtype=torch.uint8).view(4, 3)  # N, C
    out = Normalize(MEAN, STD)(x)
    expected = (x.float() - torch.tensor(MEAN)) / torch.tensor(STD)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_inactive_without_arguments() -> None:
    assert not Normalize().active
    assert Normalize(dtype=torch.float16).active


def test_channel_count_mismatch_names_both_counts() -> None:
    with pytest.raises(ValueError, match=r"3 channels but the input has 1"):
        Normalize(MEAN, STD)(_images(c=1))


def test_channels_last_needs_4d() -> None:
    with pytest.raises(ValueError, match=r"`channels_last=True` needs a 4-D.*\(2, 3, 4\)"):
        Normalize(channels_last=True)(torch.zeros(2, 3, 4))


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"mean": MEAN}, ValueError, r"`mean` was given without `std`"),
        ({"std": STD}, ValueError, r"`std` was given without `mean`"),
        ({"mean": (1.0, 2.0), "std": (1.0,)}, ValueError, r"same length, got 2 and 1"),
        ({"mean": (1.0,), "std": (0.0,)}, ValueError, r"`std` must not contain 0, got \[0\.0\]"),
        ({"mean": (math.nan,), "std": (1.0,)}, ValueError, r"`mean` must be finite"),
        ({"mean": (), "std": ()}, ValueError, r"`mean` must have at least one channel"),
        ({"mean": "abc", "std": "abc"}, TypeError, r"`mean` must be a sequence of numbers"),
        ({"mean": ("a",), "std": (1.0,)}, TypeError, r"`mean` must be a sequence of numbers"),
        ({"dtype": torch.int32}, ValueError, r"`dtype` must be a floating dtype.*torch\.int32"),
        ({"dtype": "float16"}, TypeError, r"`dtype` must be a torch\.dtype, got 'float16'"),
        ({"channels_last": 1}, TypeError, r"`channels_last` must be a bool, got 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        Normalize(**kwargs)  # type: ignore[arg-type]


def test_mean_and_std_may_be_tensors() -> None:
    out = Normalize(torch.tensor(MEAN), torch.tensor(STD))(_images())
    torch.testing.assert_close(out, _reference(_images(), torch.float32), rtol=0, atol=0)
