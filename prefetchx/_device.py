"""Which device a loader targets, and the stream operations of that device.

Nothing here runs at import. A loader checks its device when it is built, without initializing
CUDA, and asks for the current device index at its first ``iter()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def check_device(device: str | torch.device | int | None) -> torch.device:
    """``device`` checked, without initializing CUDA; `with_index` completes it at first use.

    ``None`` means the current accelerator (CUDA, else `torch.accelerator`'s where torch has it)
    when one is present, and the CPU otherwise. It counts devices (which torch does without
    initializing CUDA; through NVML where it can) and never asks for the current one: a CUDA or
    other accelerator device without an index stays without one, for `with_index` to complete
    when the device is first used. Fork-based launchers (Lightning's ``ddp_fork``, notebooks)
    refuse to start once CUDA is initialized.

    Raises:
        TypeError: ``device`` is not a string, `torch.device`, int or ``None``.
        ValueError: ``device`` is malformed, does not exist or is not available.
    """
    if device is None:
        kind = _accelerator_type()
        return torch.device("cpu") if kind is None else check_device(kind)
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(
            f"`device` must be a string, a torch.device, an int or None, got "
            f"{device!r} ({type(device).__name__})."
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"`device` {device!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"`device` {device!r}: CUDA is not available on this machine.")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"`device` {device!r} does not exist: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}."
            )
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"`device` {device!r}: MPS is not available on this machine.")
        return torch.device("mps", 0 if dev.index is None else dev.index)
    accelerator = _accelerator_type()
    if accelerator != dev.type:
        raise ValueError(
            f"`device` {device!r} is not available: the accelerator here is "
            f"{accelerator or 'none'}."
        )
    count = _accelerator_api().device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"`device` {device!r} does not exist: this machine has {count} {dev.type} device(s)."
        )
    return dev


def with_index(device: torch.device) -> torch.device:
    """``device`` as `check_device` returned it, with the current device's index if it has none.

    Asking for the current device initializes CUDA (or the accelerator): call this when the
    device is first used, not when a loader is built.
    """
    if device.index is not None or device.type == "cpu":
        return device
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type, _accelerator_api().current_device_index())


def _accelerator_api() -> Any:
    """``torch.accelerator``, or ``None`` before torch 2.6, whose type stubs lack it too."""
    return getattr(torch, "accelerator", None)


def _accelerator_type() -> str | None:
    # CUDA is asked first, through torch.cuda: its check can count through NVML (with
    # PYTORCH_NVML_BASED_CUDA_CHECK=1, which Lightning sets), where torch.accelerator's first
    # versions count through the CUDA runtime, which initializes the driver (cuInit) before a
    # fork-based launcher forks.
    if torch.cuda.is_available():
        return "cuda"
    accelerator = _accelerator_api()
    if accelerator is not None:
        if not accelerator.is_available():
            return None
        current = accelerator.current_accelerator()
        return None if current is None else str(current.type)
    return None


def set_thread_device(device: torch.device) -> None:
    """Make ``device`` current in the calling thread, which starts on device 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type not in ("cpu", "mps"):
        accelerator = _accelerator_api()
        if accelerator is not None:
            accelerator.set_device_index(device.index)


class Copies:
    """Blocking copies to a device that has no side streams here (MPS, other accelerators).

    The device stage's whole use of a device goes through this object or `CudaStreams`, so
    tests can substitute a model of the device (``tests/fakecuda.py``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def is_local(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` already lives on the device (it needs no copy)."""
        return tensor.device == self.device

    def copy(self, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """``tensor`` on the device, queued on the current stream."""
        return tensor.to(self.device, non_blocking=non_blocking)


class CudaStreams(Copies):
    """The CUDA operations the device stage uses, on one device.

    The side stream is created here, once, with the device named explicitly; a loader keeps one
    `CudaStreams` per device for its whole life.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # untyped in torch

    def consumer(self) -> Any:
        """The caller's current stream on this device."""
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on_side(self, consumer: Any) -> Iterator[None]:
        """Context in which new work is queued on the side stream.

        ``consumer`` is the caller's current stream on this device, current again on leaving.
        Only this device's current stream changes; work queued for the target device runs on
        its current stream whatever the current device is. `torch.cuda.stream` did the same
        and asked for current streams on the way, 17 us a batch on an H100's host
        (benchmarks/results/RESULTS.md, GPU).
        """
        torch.cuda.set_stream(self.side)
        try:
            yield
        finally:
            torch.cuda.set_stream(consumer)

    def side_waits_for(self, stream: Any) -> None:
        """Queue, on the side stream, a wait for all work queued so far on ``stream``."""
        self.side.wait_stream(stream)

    def mark(self, stream: Any, timing: bool = False) -> Any:
        """An event recorded on ``stream`` after the work queued so far.

        ``timing`` events can be measured against each other with `elapsed_s`.
        """
        make: Any = torch.cuda.Event  # untyped in torch, in parts that differ by version
        event = make(enable_timing=timing)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        """Queue, on ``stream``, a wait for ``event``."""
        stream.wait_event(event)

    def protect(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s work queued so far is done.

        A dense tensor only: ``record_stream`` reads the storage, which a sparse tensor lacks
        (see `dense_parts`).
        """
        tensor.record_stream(stream)

    def done(self, event: Any) -> bool:
        """Whether the work before ``event`` has completed; never waits."""
        return bool(event.query())

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two timing events, once ``end`` is `done`."""
        return float(start.elapsed_time(end)) / 1e3

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked memory from torch's caching host allocator, or ``tensor``
        itself where it is page-locked already.

        That allocator records every asynchronous copy from its blocks and reuses a block only
        once the copies from it are done.
        """
        return tensor.pin_memory()


def dense_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors that hold ``tensor``'s memory: itself, or a sparse tensor's parts."""
    layout = tensor.layout
    if layout == torch.strided:
        return (tensor,)
    if layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return (tensor,)  # other layouts (jagged): record_stream handles them or says why
