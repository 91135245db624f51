"""Normalize: values against a reference computed here, dtypes, memory format, errors."""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


_OUTPUTS = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    # Computed in float32 like float16: there is no float8 arithmetic, only casts.
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", [None, *_OUTPUTS])
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


# --- fewer passes, the same bits (#13 defect 7) ----------------------------------------------


def _old_formula(
    x: torch.Tensor, dtype: torch.dtype, channels_last: bool, mean: tuple[float, ...] = MEAN
) -> torch.Tensor:
    """What Normalize computed before it was fused: cast, subtract, divide, cast, reformat."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean_t = torch.tensor(mean, dtype=work).view(shape)
    std_t = torch.tensor(STD[: len(mean)], dtype=work).view(shape)
    out = ((x.to(work) - mean_t) / std_t).to(dtype)
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers: equal bits, -0.0 apart from 0.0 and NaN equal to itself."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(as_int[t.element_size()])


def _inputs(dtype: torch.dtype, dims: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (4, 3, 6, 5) if dims == 4 else (4, 3, 7)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    # Wide values, some past float16's range, so that every output dtype rounds and saturates.
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3e4).to(dtype)


@pytest.mark.parametrize("dtype", _OUTPUTS, ids=str)
@pytest.mark.parametrize(
    "source", [torch.uint8, torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str
)
@pytest.mark.parametrize(("dims", "channels_last"), [(4, False), (4, True), (3, False)])
def test_values_are_those_of_the_unfused_formula_bit_for_bit(
    dtype: torch.dtype, source: torch.dtype, dims: int, channels_last: bool
) -> None:
    x = _inputs(source, dims)
    before = x.clone()
    out = Normalize(MEAN, STD, dtype, channels_last)(x)
    expected = _old_formula(x, dtype, channels_last)
    assert out.dtype == expected.dtype
    assert out.shape == expected.shape
    assert out.stride() == expected.stride()
    assert torch.equal(_bits(out), _bits(expected))
    assert torch.equal(x, before)  # the input is left as it was


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_dtype_alone_is_one_cast_after_channels_last(
    dtype: torch.dtype, channels_last: bool
) -> None:
    x = _inputs(torch.uint8, 4)
    out = Normalize(dtype=dtype, channels_last=channels_last)(x)
    expected = x.to(dtype)
    if channels_last:
        expected = expected.contiguous(memory_format=torch.channels_last)
    assert out.stride() == expected.stride()
    assert torch.equal(_bits(out), _bits(expected))


class _Passes(TorchDispatchMode):
    """Records every aten op that makes a new tensor as large as ``like``: a pass over it.

    Allocations and views are not passes.
    """

    NOT_PASSES = ("empty", "empty_like", "empty_strided", "view", "_unsafe_view", "select")

    def __init__(self, like: torch.Tensor) -> None:
        super().__init__()
        self.numel = like.numel()
        self.passes: list[tuple[str, list[torch.dtype], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name not in self.NOT_PASSES and any(t.numel() == self.numel for t in outputs):
            inputs = [
                t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            ]
            self.passes.append((name, inputs, outputs[0].dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_normalization_is_two_float_passes_after_a_uint8_channels_last(dtype: torch.dtype) -> None:
    x = _inputs(torch.uint8, 4)
    normalize = Normalize(MEAN, STD, dtype, channels_last=True)
    normalize(x)  # the constants are made at the first use: count the passes of the next
    with _Passes(x) as recorded:
        normalize(x)
    layout, *arithmetic = recorded.passes
    assert layout == ("clone", [torch.uint8], torch.uint8)  # channels_last, 1 byte an element
    assert [name for name, _, _ in arithmetic] in (["sub", "div_"], ["sub", "div"])
    assert arithmetic[0][1][0] == torch.uint8  # the cast happens inside the subtraction
    assert arithmetic[-1][2] == dtype  # the division writes the output dtype: no cast after


def test_a_cast_alone_is_one_pass_after_a_uint8_channels_last() -> None:
    x = _inputs(torch.uint8, 4)
    with _Passes(x) as recorded:
        Normalize(dtype=torch.bfloat16, channels_last=True)(x)
    assert recorded.passes == [
        ("clone", [torch.uint8], torch.uint8),
        ("_to_copy", [torch.uint8], torch.bfloat16),
    ]


def test_prepare_makes_the_constants_once_without_a_copy() -> None:
    normalize = Normalize(MEAN, STD, torch.float16)
    cpu = torch.device("cpu")
    with _Passes(torch.empty(3)) as recorded:  # every op that makes a 3-element tensor
        normalize.prepare(cpu)
    assert {name for name, _, _ in recorded.passes} <= {"fill_"}  # no host-to-device copy
    mean, std = normalize._constants[cpu]
    assert mean.shape == std.shape == (3,)
    assert torch.equal(_bits(mean), _bits(torch.tensor(MEAN, dtype=torch.float32)))
    assert torch.equal(_bits(std), _bits(torch.tensor(STD, dtype=torch.float32)))
    normalize.prepare(cpu)
    assert normalize._constants[cpu][0] is mean  # once per device
    x = _images()
    with _Passes(torch.empty(3)) as recorded:
        out = normalize(x)
    assert recorded.passes == []  # __call__ uses them, viewed: it makes none
    assert torch.equal(_bits(out), _bits(_reference(x, torch.float16)))


def test_prepare_without_mean_and_std_does_nothing() -> None:
    normalize = Normalize(dtype=torch.float16, channels_last=True)
    normalize.prepare(torch.device("cpu"))
    assert normalize._constants == {}


@pytest.mark.parametrize(
    "action", [copy.copy, copy.deepcopy, lambda n: pickle.loads(pickle.dumps(n))]
)
def test_a_used_normalize_copies_and_pickles_without_its_constants(action: Any) -> None:
    normalize = Normalize(MEAN, STD, torch.bfloat16, channels_last=True)
    x = _images()
    expected = normalize(x)
    copied = action(normalize)
    assert copied._constants == {}  # made again where the copy is used
    assert normalize._constants  # the original keeps its own
    assert torch.equal(_bits(copied(x)), _bits(expected))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", _OUTPUTS, ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
def test_on_a_gpu_nothing_synchronizes_and_the_bits_are_the_cpus(
    dtype: torch.dtype, channels_last: bool
) -> None:
    x = _inputs(torch.uint8, 4)
    on_gpu = x.cuda()
    normalize = Normalize(MEAN, STD, dtype, channels_last)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a blocking copy or a sync raises
    try:
        normalize.prepare(on_gpu.device)
        out = normalize(on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = _old_formula(x, dtype, channels_last)
    assert out.stride() == expected.stride()
    assert torch.equal(_bits(out.cpu()), _bits(expected))


def test_a_negative_std_warns_naming_std_and_the_value() -> None:
    from prefetchx import DataLoaderX

    with pytest.warns(UserWarning, match=r"`std` is negative on channel 1, -57\.12") as caught:
        DataLoaderX(range(4), mean=MEAN, std=(58.395, -57.12, -57.375))
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Normalize(MEAN, STD)


TORCHVISION_MEAN = (0.485, 0.456, 0.406)  # torchvision's constants, for float input in 0-1
TORCHVISION_STD = (0.229, 0.224, 0.225)


def test_unit_constants_on_uint8_input_warn_once_per_loader_with_the_fix() -> None:
    from torch.utils.data import DataLoader

    from prefetchx import DataLoaderX

    images = list(_images(n=4))
    plain = [x.tolist() for x in DataLoader(images, batch_size=2)]  # DataLoader: no normalization
    loaders = [
        DataLoaderX(images, batch_size=2, mean=TORCHVISION_MEAN, std=TORCHVISION_STD)
        for _ in range(2)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each warning raised is recorded: "once" is ours
        outs = [list(loader) for loader in (*loaders, *loaders)]  # two epochs each
    assert len(caught) == 2  # one a loader
    assert [w.filename for w in caught] == [__file__] * 2  # the loop's: its first batch
    message = str(caught[0].message)
    for words in ("`mean`", "`std`", "torch.uint8", "0-255", "Multiply", "by 255", "0-1"):
        assert words in message
    assert "123.675" in message  # the constants it means, in the input's units
    assert max(float(x.max()) for x in outs[0]) > 1100  # what the loop would have trained on
    assert [len(out) for out in outs] == [len(plain)] * 4


@pytest.mark.parametrize(
    ("x", "mean", "std"),
    [
        (
            _images(),
            tuple(255 * m for m in TORCHVISION_MEAN),
            tuple(255 * s for s in TORCHVISION_STD),
        ),
        (_images().float() / 255, TORCHVISION_MEAN, TORCHVISION_STD),
        (_images().half() / 255, TORCHVISION_MEAN, TORCHVISION_STD),
        (_images(), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),  # values as they are, in any units
    ],
)
def test_constants_on_the_inputs_scale_do_not_warn(
    x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = Normalize(mean, std)(x)
    assert float(out.abs().max()) < 3 or torch.equal(out, x.float())
