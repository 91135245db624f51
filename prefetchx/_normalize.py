"""Input normalization: dtype cast, ``(x - mean) / std`` per channel, channels_last."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Normalize:
    """What to do to the input tensor of a batch, checked once at construction.

    ``mean`` and ``std`` are in the units of the input as collated (0-255 for uint8 images) and
    apply on dim 1 of an ``N, C, ...`` input. The arithmetic runs in float32 (float64 for a
    float64 output) and is cast to ``dtype`` at the end, so float16 and bfloat16 outputs are the
    correctly rounded float32 result.

    Args:
        mean: Per-channel means, or ``None``.
        std: Per-channel standard deviations, or ``None``; both or neither.
        dtype: Floating output dtype; float32 when ``mean``/``std`` are given and it is ``None``.
        channels_last: Return a 4-D input in ``torch.channels_last`` memory format.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: Only one of ``mean``/``std``, different lengths, an empty, non-finite or zero
            value, or a non-floating ``dtype``.
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
        if self.mean is not None and self.std is not None:
            if len(self.mean) != len(self.std):
                raise ValueError(
                    f"`mean` and `std` must have the same length, got {len(self.mean)}"
                    f" and {len(self.std)}."
                )
            if any(s == 0 for s in self.std):
                raise ValueError(f"`std` must not contain 0, got {list(self.std)}.")
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
            work = torch.float32 if self.dtype in _LOW_PRECISION else self.dtype
            mean, std = self._on(x, work)
            # Out of place first: x may be the caller's tensor (or a view of the dataset).
            x = (x.to(work) - mean).div_(std)
        if self.dtype is not None:
            x = x.to(self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _on(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``mean`` and ``std`` shaped ``1, C, 1, ...`` for ``x``, made once per device."""
        key = (x.device, dtype, x.dim())
        constants = self._constants.get(key)
        if constants is None:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            constants = tuple(
                torch.tensor(values, dtype=dtype).view(shape).to(x.device)
                for values in (self.mean, self.std)
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
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"`{name}` must be finite, got {list(out)}.")
    return out
