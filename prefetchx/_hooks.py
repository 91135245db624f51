"""Extension points for the integrations with frameworks, which live at the package's edge.

The core knows no framework. An integration (`prefetchx._accelerate`) registers here when the
package is imported, to notice what a framework reads from a prefetching loader (a framework
that rebuilds the loader as its own, over a plain `DataLoader`, reads its marks and arguments
first, and the rebuilt loader has none of the stages), or to iterate a framework's own loader
with the stages beneath it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Reader = Callable[[object, str], None]
"""Told ``(owner, name)`` when ``name`` is read from ``owner``; it may warn, never raise."""


@dataclass(frozen=True)
class Beneath:
    """A framework's loader that iterates itself, with the stages beneath its iteration."""

    outer: Any
    """What the caller iterates and reads attributes from: the framework's loader."""
    loader: Any
    """The `DataLoaderX` inside it that runs the stages: its stall meter, its ``close()``."""


Adapter = Callable[[object, Any], Beneath | None]
"""Asked ``(iterable, options)`` by `Prefetcher`: the iterable as a `Beneath` with these options,
or ``None`` where the integration does not know it."""

readers: list[Reader] = []
adapters: list[Adapter] = []


def read(owner: object, name: str) -> None:
    """Tell every reader that ``name`` is being read from ``owner``."""
    for reader in readers:
        reader(owner, name)


def adapt(iterable: object, options: Any) -> Beneath | None:
    """What the first adapter that knows ``iterable`` makes of it; ``None`` if none does."""
    for adapter in adapters:
        made = adapter(iterable, options)
        if made is not None:
            return made
    return None
