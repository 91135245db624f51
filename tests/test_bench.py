"""The `prefetchx bench` command runs and reports every arm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefetchx.__main__ import main
from prefetchx._bench import Case, measure


def test_measure_shows_the_thread_overlapping_sleeps() -> None:
    results = {r.arm: r for r in measure(Case(10, 10, 12), rounds=1)}
    assert set(results) == {"plain", "recipe", "prefetchx"}
    # Serial is ~240 ms, overlapped ~130 ms: a generous bound that a loaded machine still meets.
    assert results["prefetchx"].speedup > 1.3
    assert results["plain"].speedup == pytest.approx(1.0)


def test_bench_quick_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for arm in ("plain", "recipe", "prefetchx"):
        assert arm in table
    data = json.loads(out.read_text())
    assert {row["arm"] for row in data["results"]} == {"plain", "recipe", "prefetchx"}
    assert data["meta"]["torch"]
