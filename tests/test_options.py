"""PrefetchOptions: the one home of the prefetch arguments' names, defaults, checks and docs."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX, Prefetcher
from prefetchx._options import NAMES, PrefetchOptions

FIELDS = [f for f in dataclasses.fields(PrefetchOptions) if f.init]


def _prefetch_parameters(function: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values() if p.name in NAMES]


@pytest.mark.parametrize("owner", [DataLoaderX, Prefetcher])
def test_every_prefetching_class_shows_the_options_names_defaults_and_docs(owner: Any) -> None:
    shown = _prefetch_parameters(owner)
    assert [(p.name, p.default, p.kind) for p in shown] == [
        (f.name, f.default, inspect.Parameter.KEYWORD_ONLY) for f in FIELDS
    ]
    doc = " ".join((owner.__doc__ or "").split())
    for f in FIELDS:
        assert f"{f.name}: {' '.join(f.metadata['doc'].split())}" in doc


def test_dataloaderx_declares_each_option_attribute_with_the_options_type() -> None:
    assert {name: DataLoaderX.__annotations__[name] for name in NAMES} == {
        f.name: f.type for f in FIELDS
    }


def test_the_loader_keeps_the_options_it_was_given_and_their_checked_forms() -> None:
    loader = DataLoaderX(range(4), max_prefetch=3, mean=[1, 2], std=[3, 4], device="cpu")
    options = loader._options
    assert options == PrefetchOptions(max_prefetch=3, mean=[1, 2], std=[3, 4], device="cpu")
    assert options.arguments() == {name: getattr(loader, name) for name in NAMES}
    assert options.normalize.mean == (1.0, 2.0)
    assert options.checked_device == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_prefetch = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"max_prefetch": -1}, ValueError, r"`max_prefetch` must be >= 0, got -1"),
        ({"max_prefetch": True}, TypeError, r"`max_prefetch` must be an int, got True"),
        ({"std": (1.0,)}, ValueError, r"`std` was given without `mean`"),
        ({"device": "gpu"}, ValueError, r"`device` 'gpu'"),
    ],
)
def test_bad_options_raise_at_once_naming_the_argument_and_the_value(
    kwargs: dict[str, Any], exc: type[Exception], pattern: str
) -> None:
    for make in (PrefetchOptions, lambda **kw: Prefetcher([], **kw)):
        with pytest.raises(exc, match=pattern):
            make(**kwargs)


def test_accelerates_add_stages_shows_the_same_options() -> None:
    pytest.importorskip("accelerate")
    import prefetchx.accelerate as pxa

    assert _prefetch_parameters(pxa.add_stages) == _prefetch_parameters(Prefetcher)
    assert "device_prefetch: Batches in flight" in (pxa.add_stages.__doc__ or "")


@pytest.mark.parametrize(
    ("owner", "misspelled", "meant"),
    [
        ("DataLoaderX", "max_prefech", "max_prefetch"),
        ("DataLoaderX", "batch_szie", "batch_size"),  # DataLoader's own arguments too
        ("DataLoaderX", "num_worker", "num_workers"),
        ("Prefetcher", "devce", "device"),
        ("Prefetcher", "chanels_last", "channels_last"),
    ],
)
def test_a_misspelled_argument_names_the_class_and_the_closest_argument(
    owner: str, misspelled: str, meant: str
) -> None:
    with pytest.raises(TypeError) as raised:
        if owner == "DataLoaderX":
            DataLoaderX(range(4), **{misspelled: 2})
        else:
            Prefetcher([], **{misspelled: 2})
    assert str(raised.value) == (
        f"{owner}() got an unexpected keyword argument {misspelled!r}. Did you mean {meant!r}?"
    )


def test_an_unknown_argument_is_a_type_error_as_with_dataloader() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'"):
        DataLoader(range(4), zzz=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError) as raised:
        DataLoaderX(range(4), zzz=1)
    assert str(raised.value) == "DataLoaderX() got an unexpected keyword argument 'zzz'."


def test_add_stages_names_itself_for_a_misspelled_argument() -> None:
    pytest.importorskip("accelerate")
    import prefetchx.accelerate as pxa

    with pytest.raises(TypeError, match=r"add_stages\(\) .* 'max_prefech'\. Did you mean"):
        pxa.add_stages(object(), max_prefech=1)


def test_a_negative_std_warns_at_the_callers_line_for_prefetcher_too() -> None:
    with pytest.warns(UserWarning, match=r"`std` is negative") as caught:
        Prefetcher([], mean=(1.0,), std=(-1.0,))
    assert [w.filename for w in caught] == [__file__]
