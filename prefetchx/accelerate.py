"""Hugging Face accelerate: its prepared loaders, with both prefetch stages beneath its iteration.

accelerate's ``prepare()`` rebuilds every loader as its own class over a plain `DataLoader`, and
decides where the epoch ends from its own one-batch lookahead, which a wrapper reading ahead of
it would move. These functions keep accelerate's loader as accelerate made it and replace only
the plain `DataLoader` inside it by a `DataLoaderX` with the same arguments, so that its
lookahead pulls from the stages, which run ahead beneath it.

- `prepare`: ``accelerator.prepare(...)`` for objects that include a `DataLoaderX`.
- `add_stages`: the stages beneath a loader accelerate has prepared already (the Hugging Face
  Trainer's, in a ``get_train_dataloader`` override).
- `skip_first_batches`: accelerate's, for a mid-epoch resume, keeping the stages.

Importing this module imports accelerate.
"""

from __future__ import annotations

import accelerate  # noqa: F401  # here, where a missing accelerate should say so

from prefetchx._accelerate import add_stages, prepare, skip_first_batches

__all__ = ["add_stages", "prepare", "skip_first_batches"]
