"""Input normalization: dtype cast, ``(x - mean) / std`` per channel, channels_last."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from prefetchx import _caller


class Normalize:
    """What to do to the input tensor of a batch, checked once at construction.

    ``mean`` and ``std`` are in the units of the input as collated (0-255 for uint8 images) and
    apply on dim 1 of an ``N, C, ...`` input. The arithmetic runs in float32 (float64 for a
    float64 output) and is rounded to ``dtype`` once, so float16, bfloat16 and float8 outputs
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
        UserWarning: A negative ``std``: legal (it flips the channel's sign), rarely meant. And
            once, at the first uint8 input, constants that are all at most 1 (but for mean 0 and
            std 1, which change nothing): they are on a 0-1 scale (torchvision's), which uint8
            input (0-255) cannot have.
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
                # The DataLoaderX(...) or Prefetcher(...) call, through PrefetchOptions' __init__
                # and __post_init__.
                stacklevel=5,
            )
        if not isinstance(channels_last, bool):
            raise TypeError(f"`channels_last` must be a bool, got {channels_last!r}.")
        self.channels_last = channels_last
        # All at most 1: constants for input in 0-1, which uint8 input (0-255) cannot be. Mean 0
        # and std 1 leave values as they are, in any units: they assume no scale.
        self._unit_scale = (
            self.mean is not None
            and self.std is not None
            and max(*self.mean, *self.std) <= 1
            and not (set(self.mean) == {0.0} and set(self.std) == {1.0})
        )
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        """Whether there is anything to do."""
        return self.dtype is not None or self.channels_last

    def prepare(self, device: torch.device) -> None:
        """Make the ``mean``/``std`` constants on ``device`` now, once per device.

        The device stage calls it in the caller's stream before the side stream's fence, so the
        constants are never made behind that wait. They are filled by kernels, from the values
        as Python floats: no host-to-device copy, so nothing waits for the stream. Without a
        call, `__call__` makes them at its first use on a device.
        """
        if self.mean is None or self.std is None or self.dtype is None:
            return  # no constants: nothing to subtract
        if device in self._constants:
            return
        work = _work_dtype(self.dtype)
        self._constants[device] = (
            _filled(self.mean, work, device),
            _filled(self.std, work, device),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x``, on its own device and in the current stream.

        Two passes over the float data with ``mean``/``std``: ``x - mean`` (the cast to the
        arithmetic dtype happens inside that kernel) and ``/ std`` written straight into the
        output dtype. channels_last is applied first, to the input as given (one byte an element
        for uint8). The values are those of ``((x.to(work) - mean) / std).to(dtype)``, bit for
        bit.
        """
        if self.channels_last:
            if x.dim() != 4:
                raise ValueError(
                    f"`channels_last=True` needs a 4-D N, C, H, W input, got shape "
                    f"{tuple(x.shape)}."
                )
            x = x.contiguous(memory_format=torch.channels_last)  # a no-op if it already is
        if self.mean is None:
            return x if self.dtype is None else x.to(self.dtype)
        if x.dim() < 2 or x.shape[1] != len(self.mean):
            raise ValueError(
                f"`mean`/`std` have {len(self.mean)} channels but the input has "
                f"{x.shape[1] if x.dim() >= 2 else 'no channel dim'} (shape "
                f"{tuple(x.shape)}; channels are dim 1)."
            )
        assert self.dtype is not None  # set with mean in __init__
        if self._unit_scale and x.dtype == torch.uint8:
            self._unit_scale = False  # once: the first uint8 input says it
            _warn_unit_scale(self.mean, self.std, x.dtype)  # type: ignore[arg-type]  # set with mean
        work = _work_dtype(self.dtype)
        mean, std = self._on(x)
        if x.dtype == torch.bool or torch.promote_types(x.dtype, work) != work:
            # sub refuses bool, and would compute a wider input (float64 for a float32
            # output) in its own dtype: cast first, as the arithmetic dtype demands.
            x = x.to(work)
        # Out of place: x may be the caller's tensor (or a view of the dataset).
        centred = torch.sub(x, mean)
        if self.dtype == work:
            return centred.div_(std)
        if self.dtype.itemsize == 1:
            # float8: a division written into a float8 output would cast inside the kernel,
            # which has not run on a GPU here; cast afterwards, as before.
            return centred.div_(std).to(self.dtype)
        # A narrower output: the float32 quotient is rounded once, as it is stored.
        return torch.div(centred, std, out=torch.empty_like(centred, dtype=self.dtype))

    def _on(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``mean`` and ``std`` for ``x``, viewed ``1, C, 1, ...`` (a free view)."""
        self.prepare(x.device)
        mean, std = self._constants[x.device]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return mean.view(shape), std.view(shape)

    def __getstate__(self) -> dict[str, object]:
        # A copy makes its own constants where it is used: device tensors do not travel.
        return {**self.__dict__, "_constants": {}}


def _warn_unit_scale(mean: tuple[float, ...], std: tuple[float, ...], dtype: torch.dtype) -> None:
    """Say that 0-1 constants meet 0-255 input, what that gives, and the constants meant."""
    reach = max(max(abs(0 - m), abs(255 - m)) / abs(s) for m, s in zip(mean, std, strict=True) if s)
    _caller.warn(
        f"prefetchx: `mean`={mean} and `std`={std} are on a 0-1 scale, but the input is {dtype}, "
        f"whose units are 0-255: the normalized values reach {reach:.0f}. Multiply mean and std "
        f"by 255 (mean={_times_255(mean)}, std={_times_255(std)}), or pass float input in 0-1."
    )


def _times_255(values: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(round(v * 255, 6) for v in values)


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
    """``values`` as the checks get them, on the CPU; `_filled` converts them the same way."""
    return torch.tensor(values, dtype=dtype)


def _filled(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, each written by a fill kernel.

    A fill takes its value as an argument, converted on the host as `torch.tensor` converts it,
    so the result equals `_constant`'s bit for bit; a copy from the host would synchronize with
    the stream when the source is pageable memory.
    """
    out = torch.empty(len(values), dtype=dtype, device=device)
    for i, value in enumerate(values):
        out[i].fill_(value)
    return out


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
