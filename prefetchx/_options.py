"""The prefetch options: their names, defaults, checks and docs, in one place.

`DataLoaderX`, `Prefetcher` and `prefetchx.accelerate.add_stages` take them as keyword-only
arguments, pass them to `PrefetchOptions` (which checks them at once) and show them in their
signatures and ``help()`` from here; the pipeline builds its stages from the checked options.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
from collections.abc import Callable, Collection, Sequence
from dataclasses import field
from typing import Any

import torch

from prefetchx._checks import check_bool, check_input_key, check_int
from prefetchx._device import check_device
from prefetchx._normalize import Normalize


def _option(default: Any, doc: str) -> Any:
    """A field with its default and its doc (shown by `document`)."""
    return field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class PrefetchOptions:
    """The prefetch options of one loader, checked when made.

    Each field is a keyword-only argument of the classes that prefetch, with the same name and
    default, and its doc (the field's ``metadata["doc"]``) is the one they show. Made from bad
    values it raises at once, naming the argument and the value.

    Besides the nine values it keeps their checked forms: `normalize`, made once per options
    (it makes its device constants at first use), and `checked_device`, the device checked
    without initializing CUDA.

    Raises:
        TypeError: An option has the wrong type.
        ValueError: An option has a bad value, or ``device`` does not exist here.
    """

    max_prefetch: int = _option(
        2,
        """Batches the background thread keeps ready. ``0`` runs no thread: batches are
        produced in the caller's thread as by `DataLoader`; with a CUDA target they are pinned
        there too, unless ``pin_memory=True`` gives that to DataLoader's pin thread.""",
    )
    device: str | torch.device | int | None = _option(
        None,
        """Where batches go: ``None`` for the current accelerator if there is one, else the
        CPU (no transfer); or a device such as ``"cuda:1"``. Checked when the loader is built,
        without initializing CUDA (fork-based launchers need that); a device without an index
        takes the current device at the first ``iter()`` and keeps it for the loader's life:
        under torch.distributed call ``torch.cuda.set_device(local_rank)`` before the first
        ``iter()``, or name the rank's device.""",
    )
    mean: Sequence[float] | None = _option(
        None,
        """Per-channel means of the input, in its units as collated (0-255 for uint8 images:
        0-1 constants on uint8 input warn once), applied on dim 1 of an ``N, C, ...`` input.
        With ``std``.""",
    )
    std: Sequence[float] | None = _option(
        None, "Per-channel standard deviations; ``(x - mean) / std``."
    )
    dtype: torch.dtype | None = _option(
        None,
        """Floating dtype of the input after normalization; float32 when ``mean``/``std``
        are given.""",
    )
    channels_last: bool = _option(False, "Return a 4-D input in channels_last memory format.")
    input_key: int | str = _option(
        0,
        """Which element of a batch is the input: an index of a tuple or list batch, a key of
        a dict batch, a field name; a bare tensor batch is the input.""",
    )
    device_prefetch: int = _option(
        1,
        """Batches in flight on the device besides the caller's; each costs its size in
        device memory. ``0`` copies on demand. Copied ahead: the batches the thread has ready,
        or while the loop is faster without it, the batches ``next()`` makes after handing one
        over; with ``max_prefetch=0`` none is made ahead.""",
    )
    non_blocking: bool = _option(
        True,
        """Asynchronous copies (CUDA, from pinned memory). With a CUDA target the thread stage
        pins every CPU tensor leaf not pinned yet, so a `DataLoaderX`'s ``pin_memory`` keeps
        DataLoader's default; an explicit ``pin_memory=False`` turns that off and warns.""",
    )
    normalize: Normalize = field(init=False, repr=False, compare=False)
    """``mean``, ``std``, ``dtype`` and ``channels_last``, checked, as the stages apply them."""
    checked_device: torch.device = field(init=False, repr=False, compare=False)
    """``device`` checked; its index may be None (see `prefetchx._pipeline.Pipeline.target`)."""

    def __post_init__(self) -> None:
        check_int("max_prefetch", self.max_prefetch, minimum=0)
        check_input_key(self.input_key)
        check_int("device_prefetch", self.device_prefetch, minimum=0)
        check_bool("non_blocking", self.non_blocking)
        normalize = Normalize(self.mean, self.std, self.dtype, self.channels_last)
        object.__setattr__(self, "normalize", normalize)
        object.__setattr__(self, "checked_device", check_device(self.device))

    def arguments(self) -> dict[str, Any]:
        """The options as keyword arguments, as they were given."""
        return {name: getattr(self, name) for name in NAMES}


NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PrefetchOptions) if f.init)
"""The option names, in signature order."""


def signature(base: Callable[..., Any]) -> inspect.Signature:
    """``base``'s signature without its ``**kwargs``, followed by the options, keyword-only.

    For ``__signature__``: what `inspect`, ``help()``, IDEs and frameworks that rebuild
    loaders see of a function that takes the options as ``**kwargs``.
    """
    shown = inspect.signature(base)
    kept = [p for p in shown.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    keyword = inspect.Parameter.KEYWORD_ONLY
    ours = [
        inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
        for f in dataclasses.fields(PrefetchOptions)
        if f.init
    ]
    return shown.replace(parameters=[*kept, *ours])


def document(doc: str | None) -> str:
    """``doc`` with the options' docs appended, as a section of a Google-style docstring."""
    lines = ["", "    Prefetch arguments (keyword-only):"]
    for f in dataclasses.fields(PrefetchOptions):
        if f.init:
            entry = f"{f.name}: {' '.join(f.metadata['doc'].split())}"
            lines.append(
                textwrap.fill(entry, 96, initial_indent=" " * 8, subsequent_indent=" " * 12)
            )
    return (doc or "").rstrip() + "\n" + "\n".join(lines) + "\n"


def split(
    owner: str, kwargs: dict[str, Any], others: Collection[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` as (the prefetch options, the rest); the rest may only be names in ``others``.

    Raises:
        TypeError: A name is neither an option nor in ``others``; the message names ``owner``
            and the closest valid name.
    """
    ours = {name: value for name, value in kwargs.items() if name in NAMES}
    rest = {name: value for name, value in kwargs.items() if name not in NAMES}
    for name in rest:
        if name not in others:
            close = difflib.get_close_matches(name, [*NAMES, *others], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}.{hint}")
    return ours, rest
