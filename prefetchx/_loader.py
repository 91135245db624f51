"""`DataLoaderX`: a `DataLoader` whose iterator chains the prefetch stages."""

from __future__ import annotations

import inspect
import weakref
from typing import Any, TypeVar

from torch.utils.data import DataLoader

from prefetchx._checks import check_int
from prefetchx._thread_stage import ThreadStage

T_co = TypeVar("T_co", covariant=True)


class DataLoaderX(DataLoader[T_co]):
    """A drop-in `torch.utils.data.DataLoader` that prepares the next batches in the background.

    It takes every `DataLoader` argument, positional or keyword, with the same names and defaults,
    and yields the same batches in the same order. Its iterator runs the DataLoader iterator ahead
    in a background thread named ``prefetchx-thread``, so the next batch is produced while the
    caller trains on this one.

    Lifecycle: each ``iter()`` first stops the previous epoch's thread, then creates the
    DataLoader iterator on the calling thread and starts a new thread over it. The thread stops,
    and releases the DataLoader iterator (so its workers shut down), when the epoch ends, when the
    iterator is closed, garbage collected or left by an early ``break``, when an error is
    re-raised, when ``close()`` is called, and at interpreter exit. ``close()`` may be called any
    number of times; the loader can be iterated again after it (a closed loader reopens).

    Errors raised in the dataset, the collate function or a worker reach the caller with their
    type and traceback and end the epoch; the loader can be iterated again.

    Args:
        *args: Positional `DataLoader` arguments.
        max_prefetch: Batches the background thread keeps ready (keyword-only). ``0`` runs no
            thread: batches are produced in the caller's thread exactly as by `DataLoader`.
        **kwargs: Keyword `DataLoader` arguments.

    Raises:
        TypeError: ``max_prefetch`` is not an ``int``.
        ValueError: ``max_prefetch`` is negative.

    Example:
        >>> loader = DataLoaderX(range(10), batch_size=4, max_prefetch=2)
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    def __init__(self, *args: Any, max_prefetch: int = 2, **kwargs: Any) -> None:
        # Checked before DataLoader builds anything; stored under the argument's own name because
        # frameworks (Lightning) rebuild a loader from its __init__ signature and attributes.
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self._stage_ref: weakref.ref[ThreadStage[Any]] | None = None
        super().__init__(*args, **kwargs)

    def __iter__(self) -> ThreadStage[Any]:  # type: ignore[override]  # DataLoader names its private iterator class
        self._stop_current_epoch()
        # On the calling thread: DataLoader installs its worker-failure (SIGCHLD) handler only
        # from the main thread, and forking workers from a side thread is unsafe.
        source = super().__iter__()
        stage: ThreadStage[Any] = ThreadStage(source, self.max_prefetch)
        self._stage_ref = weakref.ref(stage)
        return stage

    def _stop_current_epoch(self) -> None:
        stage = self._stage_ref() if self._stage_ref is not None else None
        self._stage_ref = None
        if stage is None:
            return
        stage.close()
        if stage.producer_alive and self.persistent_workers:
            # Resetting the shared iterator under a thread that still calls next() on it would
            # mix two epochs' batches; refuse instead.
            raise RuntimeError(
                "prefetchx: the previous epoch's thread is still inside the DataLoader iterator, "
                "which persistent_workers=True shares between epochs; the next epoch cannot "
                "start safely. Is the dataset blocked?"
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


def _signature() -> inspect.Signature:
    """DataLoader's own signature with the prefetch arguments appended as keyword-only."""
    base = inspect.signature(DataLoader.__init__)
    ours = [
        inspect.Parameter(
            "max_prefetch", inspect.Parameter.KEYWORD_ONLY, default=2, annotation="int"
        ),
    ]
    return base.replace(parameters=[*base.parameters.values(), *ours])


# DataLoader's arguments differ between torch versions; forwarding *args/**kwargs keeps every one
# of them, and this signature shows their real names and defaults to inspect(), IDEs and
# frameworks that rebuild loaders.
DataLoaderX.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
