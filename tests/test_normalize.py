"""Normalize: values against a reference computed here, dtypes, memory format, errors."""

from __future__ import annotations

import math
import warnings

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
    "dtype",
    [
        None,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        # Computed in float32 like float16: there is no float8 arithmetic, only casts.
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
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
        (
            {"mean": (1.0, 2.0), "std": (1.0, 0.0)},
            ValueError,
            r"`std` must not be 0 in torch\.float32, the dtype it is applied in; channel 1 is "
            r"0\.0\.$",
        ),
        (
            {"mean": (math.nan,), "std": (1.0,)},
            ValueError,
            r"`mean` must be finite in torch\.float32, the dtype it is applied in; channel 0 is "
            r"nan\.$",
        ),
        (
            {"mean": (0.0,), "std": (-math.inf,), "dtype": torch.float64},
            ValueError,
            r"`std` must be finite in torch\.float64, the dtype it is applied in; channel 0 is "
            r"-inf\.$",
        ),
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


# float16 and bfloat16 outputs compute in float32, so their constants are checked there.
_IN_FLOAT32 = [None, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", _IN_FLOAT32)
@pytest.mark.parametrize(
    ("mean", "std", "pattern"),
    [
        pytest.param(
            (1e39, 0.0, 0.0),
            (1.0, 1.0, 1.0),
            r"`mean` must be finite in torch\.float32, the dtype it is applied in; channel 0 is "
            r"1e\+39, which is inf in torch\.float32\.",
            id="mean-overflows",
        ),
        pytest.param(
            (0.0, 0.0, 0.0),
            (1.0, 1.0, -1e39),
            r"`std` must be finite in torch\.float32, the dtype it is applied in; channel 2 is "
            r"-1e\+39, which is -inf in torch\.float32\.",
            id="std-overflows",
        ),
        pytest.param(
            (0.0, 0.0, 0.0),
            (1e-50, 1.0, 1.0),
            r"`std` must not be 0 in torch\.float32, the dtype it is applied in; channel 0 is "
            r"1e-50, which is 0\.0 in torch\.float32\.",
            id="std-underflows",
        ),
        pytest.param(
            (0.0, 0.0, 0.0),
            (1.0, 1e-45, 1.0),
            r"`std` must have a finite reciprocal in torch\.float32, the dtype it is applied in; "
            r"channel 1 is 1e-45, whose reciprocal is inf in torch\.float32\.",
            id="std-reciprocal-overflows",
        ),
    ],
)
def test_constants_are_checked_in_the_dtype_they_are_applied_in(
    dtype: torch.dtype | None, mean: tuple[float, ...], std: tuple[float, ...], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        Normalize(mean, std, dtype)


def test_float64_output_checks_in_float64() -> None:
    # Out of float32's range but in float64's: a float64 output computes in float64.
    mean, std = (1e39, 0.0, 0.0), (1.0, 1e-50, 1.0)
    x = _images()
    out = Normalize(mean, std, torch.float64)(x)
    work_mean = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
    work_std = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
    expected = (x.double() - work_mean) / work_std
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(
        ValueError,
        match=r"`std` must have a finite reciprocal in torch\.float64, the dtype it is applied "
        r"in; channel 1 is 1e-310, whose reciprocal is inf in torch\.float64\.",
    ):
        Normalize((0.0, 0.0), (1.0, 1e-310), torch.float64)


@pytest.mark.parametrize("dtype", _IN_FLOAT32)
def test_constants_at_the_edge_of_float32_are_taken(dtype: torch.dtype | None) -> None:
    # Near float32's largest value, and its smallest normal one, whose reciprocal is finite.
    mean, std = (3e38, 0.0, 0.0), (1.0, 1.0, 2.0**-126)
    x = torch.tensor([0, 1, 0], dtype=torch.uint8).view(1, 3, 1, 1)
    out = Normalize(mean, std, dtype)(x)
    work_mean = torch.tensor(mean).view(1, -1, 1, 1)
    work_std = torch.tensor(std).view(1, -1, 1, 1)
    expected = ((x.float() - work_mean) / work_std).to(out.dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_mean_and_std_may_be_tensors() -> None:
    out = Normalize(torch.tensor(MEAN), torch.tensor(STD))(_images())
    torch.testing.assert_close(out, _reference(_images(), torch.float32), rtol=0, atol=0)


def test_a_negative_std_warns_naming_std_and_the_value() -> None:
    from prefetchx import DataLoaderX

    with pytest.warns(UserWarning, match=r"`std` is negative on channel 1, -57\.12") as caught:
        DataLoaderX(range(4), mean=MEAN, std=(58.395, -57.12, -57.375))
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Normalize(MEAN, STD)
