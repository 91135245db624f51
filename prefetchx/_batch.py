"""Walking a nested batch: every tensor leaf, and the one leaf that is the input."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def map_tensors(batch: Any, fn: TensorFn) -> Any:
    """Return ``batch`` with ``fn`` applied to every tensor leaf.

    Tuples, lists, dicts (any `Mapping`), namedtuples and dataclass instances are rebuilt with
    their own type, as DataLoader's pinning rebuilds them (see `rebuild_mapping`); every other
    leaf is passed through unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(item, fn) for item in batch))
    if isinstance(batch, tuple):
        return type(batch)(map_tensors(item, fn) for item in batch)
    if isinstance(batch, list):
        return rebuild_list(batch, [map_tensors(item, fn) for item in batch])
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {key: map_tensors(value, fn) for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: map_tensors(getattr(batch, f.name), fn)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor leaf of ``batch``, in the order `map_tensors` visits them."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from iter_tensors(item)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            if f.init:
                yield from iter_tensors(getattr(batch, f.name))


def map_input(batch: Any, input_key: int | str, fn: TensorFn) -> Any:
    """Return ``batch`` with ``fn`` applied to its input, the leaf that ``input_key`` selects.

    A bare tensor batch is the input itself; otherwise ``input_key`` indexes a tuple, list or
    namedtuple, or names a key of a mapping, a field of a namedtuple or of a dataclass.

    Raises:
        TypeError: ``input_key`` cannot select from this kind of batch, or the input is not a
            tensor.
        ValueError: ``input_key`` is not in the batch.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        if input_key not in batch:
            raise ValueError(
                f"`input_key` {input_key!r} is not a key of the batch; its keys are {list(batch)}."
            )
        new = dict(batch)
        new[input_key] = _apply(batch[input_key], input_key, fn)
        return rebuild_mapping(batch, new)
    if isinstance(input_key, str):
        fields = _field_names(batch)
        if fields is None:
            raise TypeError(
                f"`input_key` {input_key!r} names a key, but the batch is a "
                f"{type(batch).__name__}; use an int index."
            )
        if input_key not in fields:
            raise ValueError(
                f"`input_key` {input_key!r} is not a field of the batch; its fields are {fields}."
            )
        value = _apply(getattr(batch, input_key), input_key, fn)
        if dataclasses.is_dataclass(batch):
            return dataclasses.replace(batch, **{input_key: value})  # type: ignore[type-var]  # an instance, checked by _field_names
        return batch._replace(**{input_key: value})
    if isinstance(batch, (list, tuple)):
        if not -len(batch) <= input_key < len(batch):
            raise ValueError(
                f"`input_key` {input_key} is out of range for a batch of {len(batch)} elements."
            )
        items = list(batch)
        items[input_key] = _apply(items[input_key], input_key, fn)
        if hasattr(batch, "_fields"):
            return type(batch)(*items)
        if isinstance(batch, list):
            return rebuild_list(batch, items)
        return type(batch)(items)
    raise TypeError(
        f"`input_key` {input_key!r} cannot select the input from a batch of type "
        f"{type(batch).__name__}; batches must be a tensor, a tuple, a list, a "
        "namedtuple, a mapping or a dataclass."
    )


def rebuild_mapping(batch: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """``batch`` with ``items`` for its values, as DataLoader's pinning rebuilds a mapping.

    A mutable mapping is copied and updated, so that what its constructor does not take (a
    `collections.defaultdict`'s factory, a subclass's own attributes) is kept; any other is
    built from a dict; one that takes neither becomes a plain dict.
    """
    try:
        if isinstance(batch, MutableMapping):
            clone = copy.copy(batch)
            clone.update(items)
            return clone
        return type(batch)(items)  # type: ignore[call-arg]  # a Mapping's constructor is its own
    except TypeError:
        return items


def rebuild_list(batch: list[Any], items: list[Any]) -> list[Any]:
    """``batch`` with ``items`` for its elements, as DataLoader's pinning rebuilds a list: a
    copy with each element set (a subclass's constructor may take other arguments)."""
    try:
        clone = copy.copy(batch)
        for i, item in enumerate(items):
            clone[i] = item
    except TypeError:
        return items
    return clone


def _apply(value: Any, input_key: int | str, fn: TensorFn) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"the input selected by `input_key` {input_key!r} must be a tensor, got "
            f"{type(value).__name__}."
        )
    return fn(value)


def _field_names(batch: Any) -> list[str] | None:
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return list(batch._fields)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [f.name for f in dataclasses.fields(batch)]
    return None
