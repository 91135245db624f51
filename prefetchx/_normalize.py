"""Input normalization: dtype cast, ``(x - mean) / std`` per channel, channels_last."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch


class Normalize:
    """What to do to the input tensor of a batch, checked once at construction.

    ``mean`` and ``std`` are in the units of the input as collated (0-255 for uint8 images) and
    apply on dim 1 of an ``N, C, ...`` input. The arithmetic runs in float32 (float64 for a
    float64 output) and is cast to ``dtype`` at the end, so float16, bfloat16 and float8 outputs
    are the correctly rounded float32 result. The constants are checked in that dtype too: each
    must be finite there, and each ``std`` nonzero with a finite reciprocal, so
    ``mean=(1e39, ...)`` or ``std=(1e-50, ...)`` is refused for a float32, float16 or bfloat16
    output and taken for a float64 one.

    Args:
        mean: Per-channel means, or ``None``.
        std: Per-channel standard deviations, or ``None``; both or neither.
        dtype: Floating output dtype; float32 when ``mean``/``std`` are given and it is ``None``.
        channels_last: Return a 4-D input in ``torch.channels_last`` memory format.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: Only one of ``mean``/``std``, different lengths, an empty sequence, a
            non-floating ``dtype``, or a value that is not finite, a ``std`` that is 0 or whose
            reciprocal is not finite, in the dtype the arithmetic runs in.

    Warns:
        UserWarning: A negative ``std``: legal (it flips the channel's sign), rarely meant.
    """

    def __init__(
        self,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
    ) -> None:
        if (mean is None) != (std is None):
            given, missing = ("mean", "std") if mean is not None else ("std", "mean")
            raise ValueError(f"`{given}` was given without `{missing}`; pass both or neither.")
        self.mean = _channels("mean", mean)
        self.std = _channels("std", std)
        if self.mean is not None and self.std is not None and len(self.mean) != len(self.std):
            raise ValueError(
                f"`mean` and `std` must have the same length, got {len(self.mean)}"
                f" and {len(self.std)}."
            )
        if dtype is not None:
            if not isinstance(dtype, torch.dtype):
                raise TypeError(
                    f"`dtype` must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})."
                )
            if not dtype.is_floating_point:
                raise ValueError(
                    f"`dtype` must be a floating dtype such as torch.float32, "
                    f"torch.float16 or torch.bfloat16, got {dtype}."
                )
        if dtype is None and self.mean is not None:
            dtype = torch.float32
        self.dtype = dtype
        if self.mean is not None and self.std is not None and dtype is not None:
            _check_constants(self.mean, self.std, _work_dtype(dtype))
        if self.std is not None and min(self.std) < 0:  # legal, but almost always a mistake
            channel = next(i for i, s in enumerate(self.std) if s < 0)
            warnings.warn(
                f"`std` is negative on channel {channel}, {self.std[channel]}: it flips the sign "
                "of that channel's output; a standard deviation is positive.",
                UserWarning,
                stacklevel=4,  # the DataLoaderX(...) or Prefetcher(...) call, through Pipeline
            )
        if not isinstance(channels_last, bool):
            raise TypeError(f"`channels_last` must be a bool, got {channels_last!r}.")
        self.channels_last = channels_last
        self._constants: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, ...]] = {}

    @property
    def active(self) -> bool:
        """Whether there is anything to do."""
        return self.dtype is not None or self.channels_last

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x``, on its own device and in the current stream."""
        if self.channels_last and x.dim() != 4:
            raise ValueError(
                f"`channels_last=True` needs a 4-D N, C, H, W input, got shape {tuple(x.shape)}."
            )
        if self.mean is not None:
            if x.dim() < 2 or x.shape[1] != len(self.mean):
                raise ValueError(
                    f"`mean`/`std` have {len(self.mean)} channels but the input has "
                    f"{x.shape[1] if x.dim() >= 2 else 'no channel dim'} (shape "
                    f"{tuple(x.shape)}; channels are dim 1)."
                )
            assert self.dtype is not None  # set with mean in __init__
            work = _work_dtype(self.dtype)
            mean, std = self._on(x.device, work, x.dim())
            # Out of place first: x may be the caller's tensor (or a view of the dataset).
            x = (x.to(work) - mean).div_(std)
        if self.dtype is not None:
            x = x.to(self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def prepare(self, device: torch.device) -> None:
        """Make the constants for inputs on ``device`` now, before any fence they would wait on."""
        if self.mean is not None and self.dtype is not None:
            self._on(device, _work_dtype(self.dtype), 4)

    def _on(self, device: torch.device, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, ...]:
        """``mean`` and ``std`` shaped ``1, C, 1, ...`` for a ``dim``-D input, made once."""
        key = (device, dtype, dim)
        constants = self._constants.get(key)
        if constants is None:
            shape = (1, -1) + (1,) * (dim - 2)
            assert self.mean is not None  # only called with mean and std
            assert self.std is not None
            constants = tuple(
                _constant(values, dtype).view(shape).to(device) for values in (self.mean, self.std)
            )
            self._constants[key] = constants
        return constants


def _channels(name: str, values: Sequence[float] | None) -> tuple[float, ...] | None:
    if values is None:
        return None
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"`{name}` must be a sequence of numbers, one per channel, got {values!r}.")
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be a sequence of numbers, got {values!r}.") from None
    if not out:
        raise ValueError(f"`{name}` must have at least one channel, got {values!r}.")
    return out


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``(x - mean) / std`` runs in for a ``dtype`` output."""
    # Narrower dtypes compute in float32 and are rounded once at the end: float16 and bfloat16
    # for accuracy, float8 because torch has no float8 arithmetic, only casts.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _constant(values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as the arithmetic gets them; the checks convert them the same way."""
    return torch.tensor(values, dtype=dtype)


def _check_constants(mean: tuple[float, ...], std: tuple[float, ...], work: torch.dtype) -> None:
    """Refuse ``mean``/``std`` values that the arithmetic in ``work`` would make inf or nan.

    Each must be finite in ``work``, and each ``std`` nonzero with a finite reciprocal there. A
    Python float has float64's range: in float32 ``1e39`` is inf and ``1e-50`` is 0, and either
    would make its whole channel inf or nan with no error, so they are refused here, where the
    argument is.
    """
    mean_t, std_t = _constant(mean, work), _constant(std, work)
    _require("mean", mean, mean_t, torch.isfinite(mean_t), "be finite", work)
    _require("std", std, std_t, torch.isfinite(std_t), "be finite", work)
    _require("std", std, std_t, std_t != 0, "not be 0", work)
    # The arithmetic divides by std: a denormal std (1e-45 in float32) is not 0, but 1/std is
    # inf there, and so is x / std for every |x| >= 1.
    reciprocal = torch.reciprocal(std_t)
    _require(
        "std",
        std,
        reciprocal,
        torch.isfinite(reciprocal),
        "have a finite reciprocal",
        work,
        shown_as="whose reciprocal is",
    )


def _require(
    name: str,
    given: tuple[float, ...],
    converted: torch.Tensor,
    ok: torch.Tensor,
    rule: str,
    work: torch.dtype,
    shown_as: str = "which is",
) -> None:
    """Raise for the first channel that is not ``ok``, naming its value as given and in ``work``."""
    bad = (~ok).nonzero()
    if len(bad) == 0:
        return
    channel = int(bad[0])
    value = given[channel]
    shown = ""
    if math.isfinite(value) and value != 0:  # else it is as bad in every dtype, and says so
        shown = f", {shown_as} {converted[channel].item()} in {work}"
    raise ValueError(
        f"`{name}` must {rule} in {work}, the dtype it is applied in; channel {channel} is "
        f"{value}{shown}."
    )
