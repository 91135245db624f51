"""`DataLoaderX`: a `DataLoader` whose iterator chains the prefetch stages."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset

from prefetchx._engine import JOIN_TIMEOUT
from prefetchx._pipeline import Pipeline, Stage
from prefetchx._resume import (
    EpochIndices,
    IndexRecorder,
    Resume,
    describe,
    random_generators,
)
from prefetchx._stats import EpochStats

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

    `state_dict` and `load_state_dict` resume a broken epoch exactly, counting only the batches
    the caller received; Lightning saves and restores them in its checkpoints.

    Errors raised in the dataset, the collate function or a worker reach the caller with their
    type and traceback and end the epoch; the loader can be iterated again. Ctrl-C while waiting
    for a batch raises `KeyboardInterrupt` at once and ends the epoch.

    Args:
        *args: Positional `DataLoader` arguments.
        max_prefetch: Batches the background thread keeps ready. ``0`` runs no thread: batches
            are produced in the caller's thread as by `DataLoader`.
        device: Where batches go: ``None`` for the current accelerator if there is one, else
            the CPU (no transfer); or a device such as ``"cuda:1"``. Resolved when the loader
            is built: under torch.distributed call ``torch.cuda.set_device(local_rank)`` first,
            or name the rank's device.
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
        # attributes; the checked and resolved forms live in the pipeline.
        self._pipeline = Pipeline(
            max_prefetch=max_prefetch,
            device=device,
            mean=mean,
            std=std,
            dtype=dtype,
            channels_last=channels_last,
            input_key=input_key,
            device_prefetch=device_prefetch,
            non_blocking=non_blocking,
        )
        self.max_prefetch = max_prefetch
        self.device = device
        self.mean = mean
        self.std = std
        self.dtype = dtype
        self.channels_last = channels_last
        self.input_key = input_key
        self.device_prefetch = device_prefetch
        self.non_blocking = non_blocking
        self._recorder: IndexRecorder | None = None
        self._epoch: EpochIndices | None = None
        self._resume: Resume | None = None
        if self._pipeline.target.type == "cuda":
            kwargs = _pin_by_default(args, kwargs)
        super().__init__(*args, **kwargs)

    def __iter__(self) -> Stage:  # type: ignore[override]  # DataLoader names its private iterator class
        self._stop_current_epoch()
        resume, self._resume = self._resume, None
        recorder = self._index_recorder()
        # On the calling thread: DataLoader installs its worker-failure (SIGCHLD) handler only
        # from the main thread, and forking workers from a side thread is unsafe. A shuffling
        # sampler draws here too, in DataLoader's order.
        with recorder.epoch(resume) if recorder is not None else contextlib.nullcontext():
            batches: Iterator[Any] = super().__iter__()
        self._epoch = recorder.current if recorder is not None else None
        return self._pipeline.start(batches)

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the current epoch, or of the last one once it has ended."""
        return self._pipeline.stats

    @property
    def _index_sampler(self) -> Any:
        """DataLoader's index sampler, recorded (see `prefetchx._resume`) for map-style data."""
        recorder = self._index_recorder()
        return recorder if recorder is not None else super()._index_sampler

    def _index_recorder(self) -> IndexRecorder | None:
        if isinstance(self.dataset, IterableDataset):
            return None  # no sampler: DataLoader's placeholder draws nothing to record
        if self._recorder is None:
            # Made on first use: sampler and batch sampler never change after __init__.
            self._recorder = IndexRecorder(super()._index_sampler, random_generators(self))
        return self._recorder

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is in the epoch, as plain data, to resume it exactly later.

        Counts the batches the loop has received, not those the stages have made ahead. Call it
        when you checkpoint the model; the state fits ``torch.save`` and
        ``torch.load(weights_only=True)``. See `load_state_dict`.

        Raises:
            TypeError: The dataset is an ``IterableDataset``: it has no sampler to replay.

        Examples:
            >>> loader = DataLoaderX(range(10), batch_size=2, max_prefetch=1)
            >>> it = iter(loader)
            >>> [next(it).tolist() for _ in range(2)]
            [[0, 1], [2, 3]]
            >>> state = loader.state_dict()
            >>> state["consumed"]
            2
            >>> it.close()
            >>> again = DataLoaderX(range(10), batch_size=2)
            >>> again.load_state_dict(state)
            >>> [batch.tolist() for batch in again]
            [[4, 5], [6, 7], [8, 9]]
        """
        recorder = self._resumable("state_dict")
        resume = self._resume
        epoch, tally = self._epoch, self._pipeline.tally
        if resume is None and epoch is not None and tally is not None and not tally.ended:
            consumed = epoch.skipped + tally.count
            check = epoch.first_digest if consumed else 0
            resume = Resume(True, consumed, check, list(epoch.rng_states))
        elif resume is None:
            # Between epochs: the next one draws from the generators as they are now; the global
            # RNG is the caller's to save and restore, as for the rest of training.
            states = [
                None if g is torch.default_generator else g.get_state() for g in recorder.generators
            ]
            resume = Resume(False, 0, 0, states)
        return resume.to_state(describe(self, recorder.sampler))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict` at the next ``iter()``.

        The next epoch yields exactly the batches the saved run had not yet handed to its loop,
        in order, then later epochs draw as the saved run's would. Skipped batches are skipped
        at the sampler: their data is never loaded. The loader's own ``generator`` and a
        sampler's generator are restored; the global RNG is left alone, so without a
        ``generator`` later epochs match when you restore ``torch.get_rng_state()`` with the
        rest of your checkpoint (the resumed epoch matches either way). A
        ``DistributedSampler``'s epoch is yours to set, as always.

        Random augmentations drawn in the dataset from the workers' RNG are not replayed: they
        depend on what each worker drew before, which skipping does not load.

        Raises:
            TypeError: ``state`` is not a state of a `DataLoaderX`, or the dataset is iterable.
            ValueError: ``state`` comes from a loader with another dataset length, batch size,
                ``drop_last``, sampler or shard, or its replay draws other indices.
        """
        recorder = self._resumable("load_state_dict")
        self._resume = Resume.from_state(
            state, describe(self, recorder.sampler), len(recorder.generators)
        )

    def _resumable(self, method: str) -> IndexRecorder:
        recorder = self._index_recorder()
        if recorder is None:
            raise TypeError(
                f"prefetchx: {method}() needs a map-style dataset; an IterableDataset has no "
                "sampler to replay, so only the dataset itself can say where it was."
            )
        return recorder

    def _stop_current_epoch(self) -> None:
        if self._pipeline.stop() and self.persistent_workers:
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
