"""The core's extension points, and that the core knows no framework."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX, Prefetcher, _hooks

PACKAGE = Path(__file__).resolve().parent.parent / "prefetchx"
EDGE = {"__init__.py", "_accelerate.py", "accelerate.py"}
"""The package's face and the accelerate integration: the only modules that may name it."""


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
            names.add(node.module or "")
    return names


def test_no_core_module_imports_accelerate_or_the_edge_anywhere() -> None:
    core = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in EDGE]
    assert len(core) > 20
    found = {
        f"{path.name}: {name}"
        for path in core
        for name in _imported(path)
        if any("accelerate" in part for part in name.split("."))
    }
    assert found == set()


@pytest.fixture
def reads() -> Iterator[list[tuple[object, str]]]:
    seen: list[tuple[object, str]] = []

    def reader(owner: object, name: str) -> None:
        seen.append((owner, name))

    _hooks.readers.append(reader)
    yield seen
    _hooks.readers.remove(reader)


def test_a_loader_tells_the_readers_what_a_rebuild_reads(reads: list[Any]) -> None:
    loader = DataLoaderX(range(4), batch_size=2)
    plain = DataLoader(range(4), batch_size=2)
    assert loader.multiprocessing_context is plain.multiprocessing_context is None
    assert getattr(loader, "_a_frameworks_mark", "absent") == "absent"  # as DataLoader's
    with pytest.raises(AttributeError, match="'DataLoaderX' object has no attribute 'nothing'"):
        loader.nothing  # noqa: B018
    assert reads == [
        (loader, "multiprocessing_context"),
        (loader, "_a_frameworks_mark"),
        (loader, "nothing"),
    ]
    reads.clear()
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]  # a loop reads none
    assert reads == []


def test_a_prefetcher_tells_the_readers_what_it_forwards(reads: list[Any]) -> None:
    plain = DataLoader(range(4), batch_size=2)
    batches = Prefetcher(plain)
    assert batches.batch_size == 2
    assert reads == [(batches, "batch_size")]


def test_an_adapter_makes_the_prefetcher_iterate_the_frameworks_loader() -> None:
    class Framework:  # a loader that must iterate itself: it looks ahead, as accelerate's does
        def __init__(self) -> None:
            self.inner: DataLoaderX[Any] | None = None

        def __iter__(self) -> Iterator[Any]:
            assert self.inner is not None
            for batch in self.inner:
                yield batch * 10

    def adapter(iterable: object, options: Any) -> _hooks.Beneath | None:
        if not isinstance(iterable, Framework):
            return None
        iterable.inner = DataLoaderX(range(4), batch_size=2, **options.arguments())
        return _hooks.Beneath(outer=iterable, loader=iterable.inner)

    _hooks.adapters.append(adapter)
    try:
        framework = Framework()
        batches = Prefetcher(framework, max_prefetch=1, dtype=torch.float64)
    finally:
        _hooks.adapters.remove(adapter)
    assert [batch.tolist() for batch in batches] == [[0, 10], [20, 30]]
    assert framework.inner is not None
    assert framework.inner.max_prefetch == 1
    assert batches.stats is framework.inner.stats
    batches.close()
