"""Walking nested batches: every tensor leaf moved, only the input normalized."""

from __future__ import annotations

import collections
import dataclasses
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory

from prefetchx import DataLoaderX
from prefetchx._batch import iter_tensors, map_input, map_tensors


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    meta: dict[str, object]
    name: str = "s"


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_map_tensors_rebuilds_every_container_type() -> None:
    t = torch.ones(2)
    batch = {
        "tuple": (t, "text", None),
        "list": [t, 3],
        "pair": Pair(t, t),
        "sample": Sample(t, {"boxes": [t]}),
        "ordered": OrderedDict(a=t),
    }
    out = map_tensors(batch, _double)
    assert torch.equal(out["tuple"][0], t * 2)
    assert out["tuple"][1:] == ("text", None)
    assert out["list"][1] == 3
    assert isinstance(out["pair"], Pair)
    assert torch.equal(out["pair"].label, t * 2)
    assert isinstance(out["sample"], Sample)
    assert torch.equal(out["sample"].meta["boxes"][0], t * 2)  # type: ignore[index]
    assert out["sample"].name == "s"
    assert isinstance(out["ordered"], OrderedDict)
    assert len(list(iter_tensors(batch))) == 7
    assert torch.equal(t, torch.ones(2))  # the input batch is untouched


@pytest.mark.parametrize(
    ("batch", "key", "check"),
    [
        (torch.ones(2), 0, lambda out: torch.equal(out, torch.full((2,), 2.0))),
        (
            (torch.ones(2), torch.ones(2)),
            1,
            lambda out: out[0].sum() == 2 and out[1].sum() == 4 and isinstance(out, tuple),
        ),
        (
            [torch.ones(2), torch.ones(2)],
            -2,
            lambda out: out[0].sum() == 4 and isinstance(out, list),
        ),
        (
            {"x": torch.ones(2), "y": torch.ones(2)},
            "x",
            lambda out: out["x"].sum() == 4 and out["y"].sum() == 2,
        ),
        (
            Pair(torch.ones(2), torch.ones(2)),
            "image",
            lambda out: isinstance(out, Pair) and out.image.sum() == 4 and out.label.sum() == 2,
        ),
        (
            Pair(torch.ones(2), torch.ones(2)),
            1,
            lambda out: isinstance(out, Pair) and out.label.sum() == 4,
        ),
        (
            Sample(torch.ones(2), {}),
            "image",
            lambda out: isinstance(out, Sample) and out.image.sum() == 4,
        ),
    ],
)
def test_map_input_selects_one_leaf(batch: object, key: int | str, check: object) -> None:
    out = map_input(batch, key, _double)
    assert check(out)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("batch", "key", "exc", "pattern"),
    [
        ({"x": torch.ones(1)}, "image", ValueError, r"`input_key` 'image' is not a key.*\['x'\]"),
        ((torch.ones(1),), 3, ValueError, r"`input_key` 3 is out of range for a batch of 1"),
        ((torch.ones(1),), "image", TypeError, r"names a key, but the batch is a tuple"),
        (
            Pair(torch.ones(1), torch.ones(1)),
            "img",
            ValueError,
            r"not a field.*\['image', 'label'\]",
        ),
        (("text", torch.ones(1)), 0, TypeError, r"must be a tensor, got str"),
        (42, 0, TypeError, r"cannot select the input from a batch of type int"),
    ],
)
def test_map_input_errors_name_the_key(
    batch: object, key: int | str, exc: type[Exception], pattern: str
) -> None:
    with pytest.raises(exc, match=pattern):
        map_input(batch, key, _double)


class _Tagged(dict):  # type: ignore[type-arg]
    """A mapping whose constructor takes something other than a dict, as a defaultdict's does."""

    def __init__(self, tag: str, *args: object) -> None:
        super().__init__(*args)
        self.tag = tag


def _mappings() -> list[dict[str, torch.Tensor]]:
    plain = collections.defaultdict(list, x=torch.ones(2), y=torch.ones(2))
    tagged = _Tagged("kept", {"x": torch.ones(2), "y": torch.ones(2)})
    return [plain, tagged]


def _untensored(index: int) -> Any:
    batch = _mappings()[index]
    batch.update({key: "leaf" for key in batch})
    return batch


@pytest.mark.parametrize("index", [0, 1], ids=["defaultdict", "own-constructor"])
def test_mutable_mappings_are_copied_and_updated_as_dataloaders_pinning_does(index: int) -> None:
    # DataLoader's pin_memory copies a mutable mapping and updates the copy; type(batch)(dict)
    # raised "first argument must be callable or None" for a defaultdict (#63 item 8). The
    # reference is DataLoader's own rebuild, over leaves it passes through (pinning a tensor
    # needs an accelerator).
    pinned = pin_memory(_untensored(index))
    for out in (
        map_tensors(_mappings()[index], _double),
        map_input(_mappings()[index], "x", _double),
    ):
        assert type(out) is type(pinned)
        assert getattr(out, "tag", None) == getattr(pinned, "tag", None)
        assert getattr(out, "default_factory", None) is getattr(pinned, "default_factory", None)
        assert out["x"].tolist() == [2.0, 2.0]
    assert map_input(_mappings()[index], "x", _double)["y"].tolist() == [1.0, 1.0]


def test_a_defaultdict_batch_comes_through_the_loader_as_from_dataloader() -> None:
    def collate(items: list[int]) -> collections.defaultdict[str, Any]:
        return collections.defaultdict(list, x=torch.tensor(items, dtype=torch.float32)[:, None])

    expected = list(DataLoader(range(6), batch_size=2, collate_fn=collate))
    got = list(
        DataLoaderX(
            range(6), batch_size=2, collate_fn=collate, mean=[1.0], std=[2.0], input_key="x"
        )
    )
    assert [type(b) for b in got] == [type(b) for b in expected]
    assert [b.default_factory for b in got] == [list] * 3
    assert [((b["x"] - 1) / 2).tolist() for b in expected] == [b["x"].tolist() for b in got]
