"""`DataLoaderX`: a `DataLoader` whose iterator chains the prefetch stages."""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader

from prefetchx._batch import map_input
from prefetchx._checks import check_bool, check_input_key, check_int
from prefetchx._device import CudaStreams, resolve_device
from prefetchx._device_stage import DeviceStage
from prefetchx._engine import JOIN_TIMEOUT
from prefetchx._normalize import Normalize
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import ThreadStage

T_co = TypeVar("T_co", covariant=True)


class DataLoaderX(DataLoader[T_co]):
    """A drop-in `torch.utils.data.DataLoader` that prepares the next batches in the background.

    It takes every `DataLoader` argument, positional or keyword, with the same names and defaults,
    and yields the same batches in the same order. Its iterator runs the DataLoader iterator ahead
    in a background thread named ``prefetchx-thread``, so the next batch is produced while the
    caller trains on this one.

    A thread only helps a loop that does work between batches: while the loop's median step
    is under 50 us, batches are made in the caller's thread, in order, and the thread waits
    (see `ThreadStage`). ``loader.stats`` is the stall meter of the current or last epoch.

    With an accelerator (``device``, or the current accelerator when ``device`` is ``None``), a
    second stage copies the next ``device_prefetch`` batches to it on a side stream while the
    caller trains, and normalizes the input there; ``prefetchx._device_stage.DeviceStage``
    states the stream invariants.
    On the CPU the same normalization runs in the background thread instead.

    Lifecycle: each ``iter()`` first stops the previous epoch's thread, then creates the
    DataLoader iterator on the calling thread and starts a new thread over it. The thread stops,
    and releases the DataLoader iterator (so its workers shut down), when the epoch ends, when the
    iterator is closed, garbage collected or left by an early ``break``, when an error is
    re-raised, when ``close()`` is called, and at interpreter exit. ``close()`` may be called any
    number of times; the loader can be iterated again after it (a closed loader reopens).

    Errors raised in the dataset, the collate function or a worker reach the caller with their
    type and traceback and end the epoch; the loader can be iterated again. Ctrl-C while waiting
    for a batch raises `KeyboardInterrupt` at once and ends the epoch.

    Args:
        *args: Positional `DataLoader` arguments.
        max_prefetch: Batches the background thread keeps ready. ``0`` runs no thread: batches
            are produced in the caller's thread as by `DataLoader`.
        device: Where batches go: ``None`` for the current accelerator if there is one, else
            the CPU (no transfer); or a device such as ``"cuda:1"``.
        mean: Per-channel means of the input, in its units as collated (0-255 for uint8
            images), applied on dim 1 of an ``N, C, ...`` input. With ``std``.
        std: Per-channel standard deviations; ``(x - mean) / std``.
        dtype: Floating dtype of the input after normalization; float32 when ``mean``/``std``
            are given.
        channels_last: Return a 4-D input in channels_last memory format.
        input_key: Which element of a batch is the input: an index of a tuple or list batch, a
            key of a dict batch, a field name; a bare tensor batch is the input.
        device_prefetch: Batches in flight on the device besides the caller's; each costs its
            size in device memory. ``0`` copies on demand.
        non_blocking: Asynchronous copies (CUDA, from pinned memory). ``pin_memory`` defaults
            to ``True`` when the target is CUDA; an explicit ``False`` warns once.
        **kwargs: Keyword `DataLoader` arguments.

    All arguments after ``*args`` are keyword-only and stored as same-named attributes.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument has a bad value, or ``device`` does not exist here.

    Examples:
        >>> loader = DataLoaderX(range(10), batch_size=4, max_prefetch=2)
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    def __init__(
        self,
        *args: Any,
        max_prefetch: int = 2,
        device: str | torch.device | int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
        input_key: int | str = 0,
        device_prefetch: int = 1,
        non_blocking: bool = True,
        **kwargs: Any,
    ) -> None:
        # Checked before DataLoader builds anything. Every argument is stored under its own name
        # because frameworks (Lightning) rebuild a loader from its __init__ signature and
        # attributes; the resolved forms are private.
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self.device = device
        self.mean = mean
        self.std = std
        self.dtype = dtype
        self.channels_last = channels_last
        self.input_key = check_input_key(input_key)
        self.device_prefetch = check_int("device_prefetch", device_prefetch, minimum=0)
        self.non_blocking = check_bool("non_blocking", non_blocking)
        self._normalize = Normalize(mean, std, dtype, channels_last)
        self._target = resolve_device(device)
        self._streams: CudaStreams | None = None
        self._stage_ref: weakref.ref[ThreadStage[Any] | DeviceStage] | None = None
        self._thread_ref: weakref.ref[threading.Thread] | None = None
        self._stats = EpochStats()
        if self._target.type == "cuda":
            kwargs = _pin_by_default(args, kwargs)
        super().__init__(*args, **kwargs)

    def __iter__(self) -> ThreadStage[Any] | DeviceStage:  # type: ignore[override]  # DataLoader names its private iterator class
        self._stop_current_epoch()
        # On the calling thread: DataLoader installs its worker-failure (SIGCHLD) handler only
        # from the main thread, and forking workers from a side thread is unsafe.
        batches: Iterator[Any] = super().__iter__()
        stage: ThreadStage[Any] | DeviceStage
        if self._target.type == "cpu":
            if self._normalize.active:  # in the thread, so it overlaps the caller's step
                batches = map(self._normalize_batch, batches)
            stage = ThreadStage(batches, self.max_prefetch)
        else:
            stage = DeviceStage(
                ThreadStage(batches, self.max_prefetch, device=self._target),
                self._target,
                streams=self._side_streams(),
                normalize=self._normalize,
                input_key=self.input_key,
                device_prefetch=self.device_prefetch,
                non_blocking=self.non_blocking,
            )
        self._stage_ref = weakref.ref(stage)
        thread = stage.thread
        self._thread_ref = weakref.ref(thread) if thread is not None else None
        self._stats = stage.stats
        return stage

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the current epoch, or of the last one once it has ended."""
        return self._stats

    def _normalize_batch(self, batch: Any) -> Any:
        return map_input(batch, self.input_key, self._normalize)

    def _side_streams(self) -> CudaStreams | None:
        """The target's side stream, made once per loader; ``None`` where copies are blocking."""
        if self._target.type != "cuda":
            return None  # MPS corrupts non_blocking copies (pytorch #83015); others: no streams
        if self._streams is None:
            self._streams = CudaStreams(self._target)
        return self._streams

    def _stop_current_epoch(self) -> None:
        stage = self._stage_ref() if self._stage_ref is not None else None
        thread = self._thread_ref() if self._thread_ref is not None else None
        self._stage_ref = self._thread_ref = None
        if stage is not None:
            stage.close()  # stops the thread and waits for it, bounded
        elif thread is not None and thread is not threading.current_thread():
            # The stage was dropped after an interrupt, which stops the thread without waiting;
            # threading keeps a running thread referenced, so the weak reference still holds.
            thread.join(JOIN_TIMEOUT)
        if thread is not None and thread.is_alive() and self.persistent_workers:
            # Resetting the shared iterator under a thread that still calls next() on it would
            # mix two epochs' batches; refuse instead.
            raise RuntimeError(
                f"prefetchx: the previous epoch's thread is still inside the DataLoader iterator "
                f"after {JOIN_TIMEOUT:g} s, and persistent_workers=True shares that iterator "
                "between epochs, so the next epoch cannot start safely. Is the dataset blocked?"
            )

    def close(self) -> None:
        """Stop the current epoch's thread and shut down persistent workers. Idempotent.

        The loader stays usable: a later ``iter()`` starts afresh.
        """
        self._stop_current_epoch()
        # DataLoader keeps the iterator of persistent workers; dropping it shuts them down just as
        # deleting the loader would.
        self._iterator = None

    def __enter__(self) -> DataLoaderX[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_PREFETCH_DEFAULTS: dict[str, Any] = {
    "max_prefetch": 2,
    "device": None,
    "mean": None,
    "std": None,
    "dtype": None,
    "channels_last": False,
    "input_key": 0,
    "device_prefetch": 1,
    "non_blocking": True,
}


def _signature() -> inspect.Signature:
    """DataLoader's own signature with the prefetch arguments appended as keyword-only."""
    base = inspect.signature(DataLoader.__init__)
    ours = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in _PREFETCH_DEFAULTS.items()
    ]
    return base.replace(parameters=[*base.parameters.values(), *ours])


def _pin_by_default(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn ``pin_memory`` on unless the caller chose; warn once if they turned it off."""
    given = inspect.signature(DataLoader.__init__).bind_partial(None, *args, **kwargs).arguments
    if "pin_memory" not in given:
        return {**kwargs, "pin_memory": True}
    if not given["pin_memory"]:
        warnings.warn(
            "prefetchx: pin_memory=False with a CUDA target: host-to-device copies from pageable "
            "memory are synchronous, so the device stage cannot overlap them with the step.",
            stacklevel=3,
        )
    return kwargs


# DataLoader's arguments differ between torch versions; forwarding *args/**kwargs keeps every one
# of them, and this signature shows their real names and defaults to inspect(), IDEs and
# frameworks that rebuild loaders.
DataLoaderX.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
