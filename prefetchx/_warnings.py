"""Warnings raised while a producer thread makes a batch, shown when the caller reaches it.

With ``DataLoader`` a warning raised while a batch is made (by the dataset, the collate function
or DataLoader itself, such as its IterableDataset length check) is shown in the caller's thread,
inside the ``next()`` that returns that batch, where ``warnings.catch_warnings`` and
``pytest.warns`` see it. A producer thread makes batches earlier and elsewhere, so its warnings are
held back here and shown by the consumer when it hands over the batch they came with.

The hold-back uses the hook that the `warnings` module documents for replacement,
``warnings._showwarnmsg`` ("Hook to write a warning to a file; replace if you like"): it is
wrapped once, the first time a producer starts, and the wrapper diverts only the messages of a
thread that is capturing; every other thread's warnings pass through unchanged.

Filters apply twice: where the warning is raised (an ``"error"`` filter then makes it that
batch's error, as in DataLoader), and again where it is shown, with the caller's filters as they
are when it receives the batch: ``"ignore"`` drops it and ``"error"`` raises it from that
``next()``, as DataLoader would have raised it there. The registries of ``"default"`` and
``"once"`` count it where it was raised.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

_local = threading.local()
_lock = threading.Lock()
_shown_by: Callable[[Any], None] | None = None
"""The `warnings._showwarnmsg` that was in place before the wrapper."""


def _divert(message: Any) -> None:
    sink: list[Any] | None = getattr(_local, "sink", None)
    if sink is not None:
        sink.append(message)
    elif _shown_by is not None:
        _shown_by(message)


def capture_in_this_thread() -> list[Any]:
    """Hold back the warnings the calling thread raises from now on; return where they go.

    The caller takes what gathers in the list (``warnings.WarningMessage`` objects) and passes
    it to `show` in the consumer's thread.
    """
    global _shown_by
    with _lock:
        if _shown_by is None:
            _shown_by = warnings._showwarnmsg  # type: ignore[attr-defined]  # private but documented as a hook
            warnings._showwarnmsg = _divert  # type: ignore[attr-defined]
    sink: list[Any] = []
    _local.sink = sink
    return sink


def show(messages: Sequence[Any]) -> None:
    """Show held-back warnings in the calling thread, under its filters as they are now."""
    for message in messages:
        warnings.warn_explicit(
            message.message,
            message.category,
            message.filename,
            message.lineno,
            registry=None,  # counted where it was raised
            source=message.source,
        )


class Warned:
    """An item that came with warnings, on its way through a queue to the consumer."""

    __slots__ = ("item", "warnings")

    def __init__(self, item: object, messages: list[Any]) -> None:
        self.item = item
        self.warnings = messages
