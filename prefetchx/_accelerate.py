"""Everything prefetchx knows of Hugging Face accelerate; `prefetchx.accelerate` is its face.

accelerate's ``prepare()`` rebuilds every loader as its own class (``DataLoaderShard``, or
``DataLoaderDispatcher``) over a plain `DataLoader`, and decides where the epoch ends from its
own one-batch lookahead: a wrapper that reads ahead of it would flip ``end_of_dataloader`` early
(optimizer steps lost under gradient accumulation, evaluation samples dropped). The functions
here keep accelerate's loader exactly as accelerate made it and replace only the plain
`DataLoader` inside it by a `DataLoaderX` with the same arguments: accelerate's sharding,
``set_epoch``, lookahead, ``end_of_dataloader``/``remainder``, gradient-accumulation sync and
device placement run unchanged, and its lookahead pulls from the stages, which run ahead
beneath it.

This module is imported with the package, and imports accelerate only in the functions that
`prefetchx.accelerate` exports: until accelerate is imported, none of its loaders exists and
none of its functions runs. It registers into the core's extension points (`prefetchx._hooks`):

- an adapter, so that a `Prefetcher` over accelerate's loader iterates a copy of it with the
  stages beneath it;
- a reader, which warns at once, with the fix, where accelerate's own functions would drop the
  stages of a `DataLoaderX` silently:

  * ``accelerator.prepare(loader)`` reads ``_is_accelerate_prepared``, accelerate's mark of a
    loader it prepared, before rebuilding any other: a `DataLoaderX` has no such attribute, and
    the reader is told when accelerate asks for it;
  * accelerate's ``skip_first_batches`` (``accelerator.skip_first_batches`` and the Hugging Face
    Trainer call it) takes the loader's DataLoader arguments with ``getattr`` and builds a new
    loader from them. It sets and calls nothing on the loader that marks the reads as its own,
    so this is the one detection that looks at the stack: a read of
    ``multiprocessing_context`` (which nothing in a training loop reads) warns when the
    function that accelerate exports as ``accelerate.skip_first_batches`` is running beneath
    it, found by that function's code object, through accelerate's own frames only. Neither
    its name nor its module is matched, so a renamed helper, a comprehension frame or a moved
    module inside accelerate does not turn the warning off.

The warnings point at the first caller outside prefetchx and accelerate (`prefetchx._caller`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from prefetchx import _caller, _hooks, _options
from prefetchx._hooks import Beneath
from prefetchx._loader import DataLoaderX
from prefetchx._options import PrefetchOptions
from prefetchx._prefetcher import Prefetcher

# DataLoader's arguments besides those that choose the batches (sampler, batch sampler, batch
# size, drop_last), which the rebuild takes as the loader resolved them.
_BATCHING = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
_OTHER_ARGS = tuple(
    name
    for name in inspect.signature(DataLoader.__init__).parameters
    if name != "self" and name not in _BATCHING
)


def prepare(accelerator: Any, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)``, keeping the stages of every `DataLoaderX` among them.

    Everything is prepared by accelerate itself, as ``accelerator.prepare`` would, and comes back
    in the same order (one object alone, unpacked). A `DataLoaderX` comes back as the loader
    accelerate makes of it, sharded, registered for ``save_state`` and for gradient
    accumulation, with the `DataLoaderX`'s stages and arguments beneath accelerate's iteration
    (see `add_stages`).

    Args:
        accelerator: An ``accelerate.Accelerator``.
        *objects: What ``accelerator.prepare`` takes: loaders, models, optimizers, schedulers.
        device_placement: As ``accelerator.prepare``'s.

    Returns:
        The prepared objects, as ``accelerator.prepare`` returns them.

    Raises:
        ValueError: The accelerator uses ``use_stateful_dataloader=True`` (not supported; a
            `DataLoaderX` has its own ``state_dict``).
        TypeError: accelerate made a loader of a kind that cannot take the stages (XLA's).

    Example:
        ```python
        model, optimizer, loader = prefetchx.accelerate.prepare(
            accelerator, model, optimizer, DataLoaderX(dataset, batch_size=64, mean=..., std=...)
        )
        ```
    """
    with _preparing():
        result = accelerator.prepare(*objects, device_placement=device_placement)
    prepared = result if len(objects) > 1 else (result,)
    for given, made in zip(objects, prepared, strict=True):
        if isinstance(given, DataLoaderX) and made is not given:
            _beneath(made, given._options.arguments(), pin_host=given._pipeline.pin_host)
    return result


def add_stages(loader: Any, **options: Any) -> Any:
    """Put both stages beneath a loader accelerate prepared, in place, and return it.

    The `DataLoader` inside accelerate's loader is replaced by a `DataLoaderX` with the same
    arguments (the same dataset, batch sampler, collate function, workers and generator objects)
    and these prefetch arguments; accelerate's loader itself is unchanged, so it shards, sets
    epochs, looks one batch ahead, reports ``end_of_dataloader``/``remainder`` and places
    batches exactly as before, on batches the stages made ahead. A loader that has the stages
    already is returned as it is.

    Batches go where accelerate puts them: ``device=None`` means accelerate's device when it
    places batches, else the host (normalized in the thread). accelerate's lookahead holds one
    batch more than a `DataLoaderX` alone: with a device stage, one more batch on the device.

    Args:
        loader: What ``accelerator.prepare`` or ``accelerator.prepare_data_loader`` returned for
            a `DataLoader` (a ``DataLoaderShard`` or ``DataLoaderDispatcher``).
        **options: The prefetch arguments, keyword-only, as `DataLoaderX`'s (``help()`` shows
            them); ``device=None`` means where accelerate places batches.

    Returns:
        ``loader``, with the stages.

    Raises:
        TypeError: ``loader`` is not a loader accelerate prepared, or is XLA's, or a keyword is
            none of the prefetch arguments (the message names the closest one).
        ValueError: ``loader`` wraps a torchdata ``StatefulDataLoader``
            (``use_stateful_dataloader=True``), or a prefetch argument is bad.

    Example:
        ```python
        class PrefetchingTrainer(transformers.Trainer):
            def get_train_dataloader(self):
                return prefetchx.accelerate.add_stages(super().get_train_dataloader())
        ```
    """
    given, _ = _options.split("add_stages", options)
    _beneath(loader, given, pin_host=True)
    return loader


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """accelerate's ``skip_first_batches``, keeping the stages of a loader that has them.

    accelerate rebuilds the loader to skip the first ``num_batches`` at the sampler, without
    loading them, as a plain `DataLoader`; this puts the same stages beneath the loader it
    returns. A `Prefetcher` over any other loader gives a `Prefetcher` with the same arguments
    over that loader skipped into. Any other loader gets accelerate's result unchanged.
    accelerate's function itself, and ``accelerator.skip_first_batches``, warn when given a
    loader with the stages, and return one without them.

    The Hugging Face Trainer calls accelerate's function from its own module on a mid-epoch
    resume: ``transformers.trainer.skip_first_batches = prefetchx.accelerate.skip_first_batches``
    keeps the stages there too.

    Args:
        dataloader: A loader, prepared by accelerate or not.
        num_batches: How many batches to skip.

    Returns:
        A loader that yields the batches after the first ``num_batches``.
    """
    import accelerate.data_loader

    if isinstance(dataloader, Prefetcher):
        if dataloader._beneath is None:  # over any other loader: the same stages over its skip
            return Prefetcher(
                skip_first_batches(dataloader.iterable, num_batches),
                **dataloader._options.arguments(),
            )
        dataloader = dataloader._beneath.outer  # its copy of accelerate's loader, with the stages
    with _preparing():
        skipped = accelerate.data_loader.skip_first_batches(dataloader, num_batches=num_batches)
    source = dataloader.base_dataloader if _is_accelerates(dataloader) else dataloader
    if not isinstance(source, DataLoaderX):
        return skipped
    stages = source._options.arguments()
    if _is_accelerates(skipped):
        _beneath(skipped, stages, pin_host=source._pipeline.pin_host)
        return skipped
    return _rebuild(skipped, stages, pin_host=source._pipeline.pin_host)


def _copy_with_stages(loader: Any, options: PrefetchOptions) -> Any:
    """A copy of accelerate's ``loader`` with the stages beneath it; ``loader`` is unchanged.

    For `Prefetcher`, which must not change the loader it is given. The copy shares everything
    with ``loader`` (dataset, samplers, accelerate's settings) but its epoch counter, its
    end-of-data state and the `DataLoaderX` inside it.
    """
    copy = object.__new__(type(loader))
    copy.__dict__.update(loader.__dict__)
    _beneath(copy, options.arguments(), pin_host=True)
    return copy


def _beneath(loader: Any, stages: dict[str, Any], *, pin_host: bool) -> None:
    """Replace the `DataLoader` inside accelerate's ``loader`` by a `DataLoaderX` twin."""
    if not _is_accelerates(loader):
        raise TypeError(
            "prefetchx: expected a loader accelerate prepared (DataLoaderShard or "
            f"DataLoaderDispatcher), got {type(loader).__name__}; XLA's MpDeviceLoaderWrapper "
            "cannot take the stages."
        )
    base = loader.base_dataloader
    if isinstance(base, DataLoaderX):
        return
    if getattr(loader, "use_stateful_dataloader", False):
        raise ValueError(
            "prefetchx: accelerate was configured with use_stateful_dataloader=True, which wraps "
            "a torchdata StatefulDataLoader; the stages cannot go beneath it. Leave it off: a "
            "DataLoaderX has its own state_dict() for exact mid-epoch resume."
        )
    stages = dict(stages)
    if stages.get("device") is None:
        stages["device"] = _placement(loader)
    loader.base_dataloader = _rebuild(base, stages, pin_host=pin_host)


def _rebuild(base: DataLoader[Any], stages: dict[str, Any], *, pin_host: bool) -> DataLoaderX[Any]:
    """A `DataLoaderX` that draws and yields as ``base`` does, with the given stages.

    The same objects (dataset, sampler or batch sampler, collate function, generator, worker
    settings) are handed over, so samplers' epochs and generators stay shared with ``base``.
    """
    kwargs: dict[str, Any] = {name: getattr(base, name) for name in _OTHER_ARGS}
    if not kwargs["pin_memory"]:
        del kwargs["pin_memory"]  # DataLoader's default; an explicit False would turn pinning off
    if isinstance(base.dataset, IterableDataset):
        kwargs.update(batch_size=base.batch_size, drop_last=base.drop_last)
    elif base.batch_sampler is None:  # no batching: one sample at a time
        kwargs.update(batch_size=None, sampler=base.sampler)
    elif base.batch_size is None:  # a batch sampler of its own
        kwargs.update(batch_sampler=base.batch_sampler)
    else:
        kwargs.update(batch_size=base.batch_size, sampler=base.sampler, drop_last=base.drop_last)
    twin: DataLoaderX[Any] = DataLoaderX(base.dataset, **kwargs, **stages)
    twin._pipeline.pin_host = pin_host
    # accelerate asks its loader whether it is prepared already, and its loader asks the
    # DataLoader inside: this one is, and must not be prepared again without its stages.
    twin._is_accelerate_prepared = True  # accelerate's own mark, read with getattr
    return twin


def _placement(loader: Any) -> torch.device | str:
    """Where accelerate's ``loader`` puts batches: its device, or the host."""
    import accelerate.data_loader

    if isinstance(loader, accelerate.data_loader.DataLoaderDispatcher):
        return torch.device(loader.state.device)
    device = loader.__dict__.get("device")  # DataLoaderShard's; None when it does not place
    return device if device is not None else "cpu"


def _is_accelerates(loader: Any) -> bool:
    """Whether ``loader`` is one accelerate prepared; without importing accelerate."""
    module = sys.modules.get("accelerate.data_loader")
    adapter = getattr(module, "DataLoaderAdapter", None)
    # type(), not isinstance(): accelerate's loaders report the class of the DataLoader inside.
    return adapter is not None and issubclass(type(loader), adapter)


_inside = threading.local()
"""``active`` while prefetchx has accelerate prepare or skip into a `DataLoaderX` here."""


@contextlib.contextmanager
def _preparing() -> Iterator[None]:
    """While prefetchx has accelerate prepare or skip into a `DataLoaderX`, it does not warn."""
    previous = getattr(_inside, "active", False)
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = previous


DROPS_STAGES = (
    "prefetchx: accelerate's prepare() rebuilds this DataLoaderX as its own loader over a plain "
    "DataLoader: the prefetch thread, the device stage and mean/std/dtype/channels_last are "
    "dropped, so batches come unnormalized. Use prefetchx.accelerate.prepare(accelerator, ...) "
    "instead of accelerator.prepare(...): it prepares the same way and keeps both stages."
)

SKIP_DROPS_STAGES = (
    "prefetchx: accelerate's skip_first_batches() (accelerator.skip_first_batches() calls it) "
    "rebuilds this loader over a new plain DataLoader: the prefetch thread, the device stage and "
    "mean/std/dtype/channels_last are dropped from the loader it returns, so its batches come "
    "unnormalized. Use prefetchx.accelerate.skip_first_batches(loader, num_batches) instead: it "
    "skips the same way and keeps both stages (the Hugging Face Trainer calls accelerate's: "
    "transformers.trainer.skip_first_batches = prefetchx.accelerate.skip_first_batches)."
)


def _noticed(owner: object, name: str) -> None:
    """The reader: warn where accelerate's own prepare or skip would drop the stages."""
    if getattr(_inside, "active", False):
        return
    if name == "_is_accelerate_prepared" and isinstance(owner, DataLoaderX):
        _caller.warn(DROPS_STAGES, skip=_accelerates_files())
    elif name == "multiprocessing_context" and _drops_on_skip(owner) and _skipping():
        _caller.warn(SKIP_DROPS_STAGES, skip=_accelerates_files())


def _drops_on_skip(owner: object) -> bool:
    """Whether a rebuild of ``owner`` from what it reads loses stages it has."""
    if isinstance(owner, DataLoaderX):
        return True
    # A Prefetcher forwards the read: to a DataLoaderX, which says so itself, or to accelerate's
    # loader copied with a DataLoaderX beneath it, which does too.
    return (
        isinstance(owner, Prefetcher)
        and owner._beneath is None
        and not isinstance(owner.iterable, DataLoaderX)
    )


def _skipping() -> bool:
    """Whether accelerate's ``skip_first_batches`` is running beneath the reader's caller.

    Walked from the read up through prefetchx's and accelerate's frames only: the first frame
    outside both (the caller's own code) ends the search.
    """
    skip = getattr(sys.modules.get("accelerate"), "skip_first_batches", None)
    code = getattr(inspect.unwrap(skip), "__code__", None) if skip is not None else None
    if code is None:
        return False
    ours = (_caller.PACKAGE, *_accelerates_files())
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        if frame.f_code is code:
            return True
        frame = frame.f_back  # type: ignore[assignment]  # None ends the walk
    return False


def _accelerates_files() -> tuple[str, ...]:
    """The directory accelerate's modules' file names begin with; none before it is imported."""
    module = sys.modules.get("accelerate")
    path = getattr(module, "__file__", None)
    return (os.path.dirname(os.path.abspath(path)) + os.sep,) if path else ()


def _adapt(iterable: object, options: PrefetchOptions) -> Beneath | None:
    """The adapter: accelerate's loader, copied with the stages beneath it."""
    if not _is_accelerates(iterable):
        return None
    copy = _copy_with_stages(iterable, options)
    return Beneath(outer=copy, loader=copy.base_dataloader)


_hooks.readers.append(_noticed)
_hooks.adapters.append(_adapt)

add_stages.__signature__ = _options.signature(add_stages)  # type: ignore[attr-defined]
add_stages.__doc__ = _options.document(add_stages.__doc__)
