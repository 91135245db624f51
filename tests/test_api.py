"""The public API is exactly what `prefetchx.__all__` lists."""

from __future__ import annotations

import prefetchx


def test_public_names_are_pinned_and_sorted() -> None:
    assert prefetchx.__all__ == [
        "DataLoaderX",
        "EpochStats",
        "Prefetcher",
        "ThreadStage",
        "fast_collate",
    ]
    assert prefetchx.__all__ == sorted(prefetchx.__all__)
    for name in prefetchx.__all__:
        assert getattr(prefetchx, name) is not None
