"""The `prefetchx bench` command runs and reports every arm."""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetchx import DataLoaderX
from prefetchx.__main__ import main
from prefetchx.bench import cli, synthetic
from prefetchx.bench.paired import (
    Spread,
    compare,
    judge,
    ratios,
    round_order,
    run_rounds,
    too_busy,
    uncertainty,
)
from prefetchx.bench.synthetic import (
    COLUMNS,
    UNITS,
    WARM_BATCHES,
    Case,
    RunAhead,
    Work,
    bound,
    conclude,
    format_table,
    legend,
    machine_meta,
    measure,
    overlaps,
    release,
)
from tests.helpers import Squares, needs_records

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "bench-cpu-2core.json"


def test_measure_runs_every_arm_in_paired_rounds_and_bounds_the_prefetching_ones() -> None:
    results = {r.arm: r for r in measure(Case("sleep", 2, 2, 12))}
    assert list(results) == ["plain", "again", "recipe", "prefetchx", "warmed"]
    plain = results["plain"]
    assert plain.speedups == [1.0] * 5  # paired with itself, round by round
    for arm, r in results.items():
        assert len(r.speedups) == len(r.epochs_s) == 5, arm
        assert r.speedup_low <= r.speedup <= r.speedup_high, arm
    # The bound comes from plain's own calls in each round; only the arms that run the loader
    # ahead in a thread are held to it (plain and its twin make each batch when asked).
    for arm in ("recipe", "prefetchx", "warmed"):
        ours = results[arm]
        assert ours.bound_s is not None
        assert ours.overlap_efficiency is not None
        assert len(ours.bounds_s) == 5, arm
    for arm in ("plain", "again"):
        r = results[arm]
        assert (r.bound_s, r.overlap_efficiency, r.per_batch_us) == (None, None, None)
    assert plain.data_call_ms is not None
    assert plain.step_call_ms is not None


def test_a_case_with_no_work_has_no_bound() -> None:
    results = measure(Case("sleep", 0, 0, 50, arms=("plain", "prefetchx", "inline", "floor")))
    assert [r.arm for r in results] == ["plain", "prefetchx", "inline", "floor"]
    for r in results:
        assert r.bound_s is None
        assert r.overlap_efficiency is None
        assert len(r.speedups) == 5
    with pytest.raises(ValueError, match="must include 'plain'"):
        measure(Case("sleep", 0, 0, 5, arms=("recipe", "prefetchx")))


class _Clock:
    """A clock that moves only when told: times from it depend on no machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("batches", [12, WARM_BATCHES + 1])
def test_every_arm_but_warmed_is_a_new_loader_each_round_timed_from_before_it_is_made(
    batches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue #64: 128 untimed batches an arm hid what a new loader pays in its first batches.
    # Each arm's loader costs 100 "seconds" to make and each of its batches 1, on a clock of
    # our own: a new loader's epoch reads both, the warmed one's its batches alone.
    clock = _Clock()
    monkeypatch.setattr(synthetic, "time", clock)
    made: collections.Counter[str] = collections.Counter()
    epochs: collections.Counter[str] = collections.Counter()

    def factory(name: str, real: Any) -> Any:
        def make(dataset: Any, depth: int, kw: dict[str, Any]) -> Any:
            made[name] += 1
            clock.now += 100.0

            def counted() -> Any:
                epochs[name] += 1
                for batch in real(dataset, depth, kw):
                    clock.now += 1.0
                    yield batch

            return _Iterable(counted)

        return make

    arms = ("plain", "again", "prefetchx", "warmed")
    for name in arms:
        monkeypatch.setitem(synthetic.ARMS, name, factory(name, synthetic.ARMS[name]))
    results = {r.arm: r for r in measure(Case("sleep", 0, 0, batches, arms=arms))}
    for name in ("plain", "again", "prefetchx"):
        assert (made[name], epochs[name]) == (5, 5), name  # one new loader, one epoch, a round
        assert results[name].epochs_s == [100.0 + batches] * 5, name
    assert made["warmed"] == 1
    warm = epochs["warmed"] - 5  # the rounds' epochs, one a round
    assert warm * batches >= WARM_BATCHES  # enough untimed batches
    assert warm == 1 or (warm - 1) * batches < WARM_BATCHES  # and no more epochs than that
    assert results["warmed"].epochs_s == [float(batches)] * 5  # the untimed ones not in them


class _Iterable:
    """An iterable whose every ``iter()`` is a new call of ``make``."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __iter__(self) -> Any:
        return self.make()


# --- the bound, on fixed numbers -----------------------------------------------------------------


def test_the_bound_when_data_dominates_is_all_the_data_and_the_last_step() -> None:
    # The sleep 10/5 row, 30 batches. The old ideal, first data + max(total data, total step),
    # counts the first batch's data twice: 310 ms. A prefetcher that keeps the producer busy
    # takes 300 ms of data plus the last 5 ms step, so an epoch of 306 ms came out "overlap
    # 1.013" and "-133 us over/batch". The bound is 305 ms: overlap below 1, over/batch > 0.
    data, step = [0.010] * 30, [0.005] * 30
    epoch = 0.306
    old = data[0] + max(sum(data), sum(step))
    assert old / epoch == pytest.approx(1.013, abs=1e-3)
    assert (epoch - old) / 30 * 1e6 == pytest.approx(-133.3, abs=0.1)
    assert bound(data, step) == pytest.approx(0.305)
    assert bound(data, step) / epoch == pytest.approx(0.9967, abs=1e-4)
    assert (epoch - bound(data, step)) / 30 * 1e6 == pytest.approx(33.3, abs=0.1)


def test_the_bound_when_the_step_dominates_is_the_first_data_and_every_step() -> None:
    assert bound([0.005] * 30, [0.010] * 30) == pytest.approx(0.005 + 0.300)
    assert bound([0.005] * 50, [0.005] * 50) == pytest.approx(0.255)  # D = C: both terms agree


def test_the_bound_is_the_pipelines_even_where_the_longest_chain_is_inside_the_epoch() -> None:
    # A slow batch in the middle: it must be made after the data before it, and its step and
    # the ones after it follow. Neither end's formula sees it.
    data, step = [0.001, 0.010, 0.001], [0.001, 0.010, 0.001]
    assert max(data[0] + sum(step), sum(data) + step[-1]) == pytest.approx(0.013)
    assert bound(data, step) == pytest.approx(0.001 + 0.010 + 0.010 + 0.001)


def test_the_bound_of_work_that_cannot_overlap_is_the_sum() -> None:
    assert bound([0.005] * 4, [0.005] * 4, overlap=False) == pytest.approx(0.040)
    assert bound([], [0.002] * 3) == pytest.approx(0.006)  # no data work: every step
    assert bound([0.002] * 3, []) == pytest.approx(0.006)
    assert bound([], []) == 0.0
    assert overlaps("sleep", cpus=1)
    assert overlaps("numpy", cpus=2)
    assert not overlaps("numpy", cpus=1)  # one core: one of them at a time
    assert not overlaps("python", cpus=16)  # the GIL


# --- paired rounds --------------------------------------------------------------------------------


def test_rounds_interleave_every_arm_in_changing_orders() -> None:
    order: list[str] = []

    def arm(name: str, seconds: float) -> Any:
        def run() -> float:
            order.append(name)
            return seconds

        return run

    times = run_rounds({"plain": arm("plain", 2.0), "a": arm("a", 1.0), "b": arm("b", 4.0)}, 3)
    assert order == ["plain", "a", "b", "b", "a", "plain", "a", "b", "plain"]
    assert times == {"plain": [2.0] * 3, "a": [1.0] * 3, "b": [4.0] * 3}
    got = ratios(times)
    assert got["a"].median == 2.0
    assert got["b"].median == 0.5
    assert got["plain"].rounds == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("arms", [2, 3, 4, 5, 6])
def test_over_twice_as_many_rounds_as_arms_each_arm_follows_each_other_and_holds_each_place(
    arms: int,
) -> None:
    orders = [round_order(arms, r) for r in range(2 * arms)]
    assert all(sorted(order) == list(range(arms)) for order in orders)
    after = collections.Counter(
        (order[i - 1], order[i]) for order in orders for i in range(1, arms)
    )
    assert set(after.values()) == {2}
    assert len(after) == arms * (arms - 1)
    places = collections.Counter(
        (place, arm) for order in orders for place, arm in enumerate(order)
    )
    assert set(places.values()) == {2}
    # Where a rotation puts an arm after the same arm in every round, the first 5 rounds give
    # each arm two different arms before it, where there are two others.
    before: dict[int, set[int]] = collections.defaultdict(set)
    for order in orders[:5]:
        for i in range(1, arms):
            before[order[i]].add(order[i - 1])
    assert all(len(others) >= min(2, arms - 1) for others in before.values())


def test_ratios_are_taken_within_each_round() -> None:
    # The machine slows down in round 2: both arms take twice as long. Unpaired medians would
    # mix rounds; the paired ratio stays 1.25 in every round.
    times = {"plain": [1.0, 2.0, 1.0, 1.0, 2.0], "x": [0.8, 1.6, 0.8, 0.8, 1.6]}
    spread = ratios(times)["x"]
    assert spread.rounds == pytest.approx([1.25] * 5)
    assert spread.ratio() == "1.25x (1.25-1.25)"
    with pytest.raises(ValueError, match="ratios pair them round by round"):
        ratios({"plain": [1.0, 1.0], "x": [1.0]})
    with pytest.raises(ValueError, match="one value per round"):
        Spread.of([])


@pytest.mark.parametrize(
    ("rounds", "twin", "outcome"),
    [
        ([1.90, 1.92, 1.93, 1.95, 1.91], None, "faster"),
        ([0.90, 0.91, 0.89, 0.90, 0.92], None, "slower"),
        ([1.00, 1.01, 0.99, 1.00, 1.00], None, "alike"),
        ([1.01, 1.01, 1.015, 1.01, 1.01], None, "alike"),  # every round above, by too little
        # The old rule's blind spot: one round above 1.0 made a loop "no difference", however
        # far its median; read by its uncertainty, a median this far below is slower.
        ([0.67, 1.10, 0.45, 0.69, 1.02], None, "slower"),
        ([0.80, 1.10, 0.60, 0.85, 1.05], None, "unsure"),  # rounds wide either side
        # Tight rounds, but plain against itself strayed 5%: a 3% median cannot be told.
        ([0.97, 0.97, 0.96, 0.97, 0.98], [1.00, 0.95, 1.06, 0.97, 1.03], "unsure"),
        ([0.97, 0.97, 0.96, 0.97, 0.98], [1.00, 0.99, 1.01, 1.00, 1.00], "slower"),
        ([1.00, 1.00, 1.00, 1.00, 1.00], [1.00, 0.95, 1.06, 0.97, 1.03], "unsure"),
    ],
)
def test_a_ratio_is_read_against_its_uncertainty(
    rounds: list[float], twin: list[float] | None, outcome: str
) -> None:
    noise = Spread.of(twin) if twin is not None else None
    assert compare(Spread.of(rounds), noise) == outcome


def test_the_uncertainty_is_two_standard_errors_of_the_median_from_the_rounds() -> None:
    spread = Spread.of([0.96, 0.98, 1.00, 1.02, 1.04])  # stdev 0.0316 over 5 rounds
    error = 1.2533 * 0.031623 / 5**0.5
    assert spread.noise == pytest.approx(error, rel=1e-3)
    assert uncertainty(spread) == pytest.approx(2 * error, rel=1e-3)
    wider = Spread.of([0.90, 1.00, 1.10, 0.95, 1.05])
    assert uncertainty(spread, wider) == uncertainty(wider)  # the larger of the two
    assert Spread.of([1.0]).noise == float("inf")  # one round says nothing of its noise
    # Too busy: plain against itself alone leaves its median more than CLEAR of noise. For 5
    # rounds that is a standard deviation above CLEAR * sqrt(5) / (2 * 1.2533) = 1.78%.
    assert too_busy(spread)  # 3.5%
    assert not too_busy(Spread.of([0.99, 0.995, 1.00, 1.005, 1.01]))  # 0.9%
    at_the_line = 0.02 * 5**0.5 / (2 * 1.2533)
    assert at_the_line == pytest.approx(0.0178, abs=1e-4)


@pytest.mark.parametrize(
    ("rounds", "twin", "verdict"),
    [
        ([0.99, 1.00, 1.01, 1.00, 1.00], None, "met"),
        ([0.74, 0.75, 0.73, 0.74, 0.76], None, "not met"),
        ([0.90, 1.00, 1.10, 0.95, 1.05], None, "too noisy to tell"),  # its own rounds straddle
        ([0.98, 0.98, 0.98, 0.98, 0.98], [1.0] * 5, "met"),
        ([0.98, 0.98, 0.98, 0.98, 0.98], [1.00, 0.95, 1.06, 0.97, 1.03], "too noisy to tell"),
        ([0.96, 0.96, 0.96, 0.96, 0.96], [1.0] * 5, "not met"),
        ([0.97, 0.97, 0.97, 0.97, 0.97], [1.0] * 5, "met"),  # on the line: met
    ],
)
def test_a_target_is_met_not_met_or_too_noisy_to_tell(
    rounds: list[float], twin: list[float] | None, verdict: str
) -> None:
    noise = Spread.of(twin) if twin is not None else None
    assert judge(Spread.of(rounds), 0.97, noise) == verdict


# --- what the output says -------------------------------------------------------------------------


def _spread(median: float, low: float, high: float) -> Spread:
    """Five rounds from ``low`` to ``high`` about ``median``."""
    return Spread.of([low, (low + median) / 2, median, (median + high) / 2, high])


FASTER = _spread(1.9, 1.85, 1.95)
SLOWER = _spread(0.8, 0.78, 0.82)
ALIKE = _spread(1.0, 0.99, 1.01)
UNSURE = _spread(0.95, 0.7, 1.2)
QUIET = _spread(1.0, 0.995, 1.005)  # plain against itself on a quiet machine
BUSY = _spread(1.0, 0.9, 1.1)  # ... and on a busy one


@pytest.mark.parametrize(
    ("loops", "counts", "advice"),
    [
        (
            [("sleep 5/5 ms", FASTER), ("no work", SLOWER), ("python", ALIKE)],
            "faster in 1 of 3 loops (up to 1.90x, sleep 5/5 ms), slower in 1 (down to 0.80x, "
            "no work), alike in 1",
            "use it where your data or step work releases the GIL, and time your own loop "
            "against max_prefetch=0 elsewhere.",
        ),
        (
            [("a", SLOWER), ("b", ALIKE)],
            "faster in none of 2 loops, slower in 1 (down to 0.80x, a), alike in 1",
            "keep the plain DataLoader here unless your own loop, timed, says otherwise.",
        ),
        (
            [("a", FASTER), ("b", ALIKE)],
            "faster in 1 of 2 loops (up to 1.90x, a), slower in none, alike in 1",
            "switching costs nothing here.",
        ),
        (
            [("a", ALIKE)],
            "faster in none of 1 loops, slower in none, alike in 1",
            "switching neither gains nor costs here.",
        ),
        (
            [("a", FASTER), ("b", UNSURE)],
            "faster in 1 of 2 loops (up to 1.90x, a), slower in none, alike in none, and too "
            "noisy to tell in 1 (the lowest 0.95x, b, its rounds 0.70x to 1.20x)",
            "use it where your loop is like those it was faster in, and time your own loop "
            "against max_prefetch=0 where it is like the others.",
        ),
        (
            [("a", ALIKE), ("b", UNSURE)],
            "faster in none of 2 loops, slower in none, alike in 1, and too noisy to tell in 1 "
            "(the lowest 0.95x, b, its rounds 0.70x to 1.20x)",
            "time your own loop against max_prefetch=0 before switching.",
        ),
    ],
)
def test_the_conclusion_counts_each_outcome_and_advises_from_the_counts(
    loops: list[tuple[str, Spread]], counts: str, advice: str
) -> None:
    sentence = conclude(loops)
    assert (
        sentence
        == f"On this machine, against a plain DataLoader, DataLoaderX was {counts}: {advice}"
    )
    assert sentence.count(". ") == 0


def test_the_conclusion_never_says_use_it_over_loops_that_were_slower_or_untold() -> None:
    # It once said "use it" over medians of 0.67x and 0.69x whose rounds reached above 1.0:
    # those loops were counted neither slower nor anything, and the advice read the rest.
    low = [
        ("JPEG, 0 workers", Spread.of([0.67, 1.10, 0.45, 0.69, 1.02])),
        ("JPEG, 2 workers", Spread.of([0.69, 1.05, 0.50, 0.70, 1.01])),
    ]
    sentence = conclude([("sleep 5/5 ms", FASTER), *low])
    assert "slower in 2 (down to 0.69x, JPEG, 0 workers)" in sentence
    assert "costs nothing" not in sentence
    assert "use it where your data or step work releases the GIL" in sentence
    alone = conclude(low)
    assert "use it" not in alone
    assert alone.endswith(
        "keep the plain DataLoader here unless your own loop, timed, says otherwise."
    )
    # A low median whose rounds are wide either side is never read as "costs nothing".
    unsure = conclude([("a", FASTER), ("b", _spread(0.87, 0.70, 1.09))])
    assert "costs nothing" not in unsure
    assert "too noisy to tell in 1 (the lowest 0.87x, b" in unsure


def test_the_conclusion_says_when_the_machine_was_too_busy_to_decide() -> None:
    tight = _spread(0.97, 0.965, 0.975)  # 3% below plain, in tight rounds
    quiet = conclude([("a", tight, QUIET)])
    assert "slower in 1 (down to 0.97x, a)" in quiet
    assert "too busy" not in quiet
    busy = conclude([("a", tight, BUSY), ("b", FASTER, BUSY)])
    # Plain against itself strayed up to 10% a round: its median's noise, two standard errors
    # of 5 rounds with a standard deviation of 7.9%, is 8.9%, above the 2% a difference clears.
    noise = uncertainty(BUSY)
    assert noise == pytest.approx(2 * 1.2533 * 0.0791 / 5**0.5, rel=1e-3)
    assert "faster in 1 of 2 loops (up to 1.90x, b)" in busy  # a large difference still tells
    assert "too noisy to tell in 1 (the lowest 0.97x, a, its rounds 0.96x to 0.97x, plain " in (
        busy
    )
    assert (
        "; the machine was too busy to decide 1 of them: plain against itself alone left a "
        f"median +/-{noise:.1%} of noise (two standard errors), above the 2% a difference must "
        "clear: use it where your loop is like those it was faster in"
    ) in busy
    nothing = conclude([("a", tight, BUSY)])
    assert nothing.endswith("nothing was decided: run it again on a quiet machine.")
    assert nothing.count(". ") == 0


def test_a_quick_run_says_so_first() -> None:
    assert conclude([("a", ALIKE)], quick=True).startswith(
        "On this machine (a --quick run, too short to decide from), against a plain DataLoader, "
    )
    assert conclude([]) == "Nothing was measured."


def test_rows_that_look_alike_say_how_they_differ() -> None:
    for grid in (cli.DEFAULT_GRID, cli.QUICK_GRID):
        seen: dict[tuple[str, float, float], list[Case]] = {}
        for case in grid:
            seen.setdefault((case.kind, case.data_ms, case.step_ms), []).append(case)
        for alike in seen.values():
            if len(alike) > 1:
                assert len({(c.batches, c.arms, c.note) for c in alike}) == len(alike)
                assert all(c.note for c in alike), alike


def test_the_table_names_every_case_and_explains_every_column() -> None:
    short = Case("sleep", 0, 0, 30, arms=("plain", "prefetchx"), note="the recipe left out")
    results = measure(short) + measure(Case("sleep", 1, 1, 10, arms=("plain", "floor")))
    table = format_table(results)
    lines = table.splitlines()
    assert lines[:2] == [
        "no work: data 0 and step 0 ms a batch, 30 batches, 5 rounds",
        "  (the recipe left out)",
    ]
    assert "sleep: data 1 and step 1 ms a batch (measured " in table
    rows = [line.split() for line in table.splitlines() if line.startswith("  plain ")]
    assert all(row[-3:] == ["-", "-", "-"] for row in rows)  # no bound for plain
    floor = next(line for line in table.splitlines() if line.startswith("  floor "))
    assert "-" not in floor.split(")")[1]  # a prefetching arm gets its bound
    explained = legend(r.arm for r in results)
    for column in COLUMNS:
        assert f"  {column}: " in explained
        assert column in lines[2]  # the head
    for arm in ("plain", "prefetchx", "floor"):
        assert f"  {arm}: " in explained


def test_bench_quick_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    arms = {"plain", "again", "recipe", "prefetchx", "warmed"}
    for arm in arms:
        assert f"\n  {arm} " in shown, arm  # a row, and its line in the legend
    assert "each a new loader timed from its first batch" in shown
    assert f"but 'warmed', one loader after {WARM_BATCHES} untimed batches" in shown
    assert "Columns:" in shown
    data = json.loads(out.read_text())
    assert {row["arm"] for row in data["results"]} == arms
    assert all(len(row["speedups"]) >= 5 for row in data["results"])
    assert data["meta"]["torch"]
    assert data["jpeg"] == []  # --quick skips the JPEG workload
    # The run ends with its conclusion, the one the record keeps ...
    last = shown.strip().split("\n\n")[-1]
    assert " ".join(last.split()) == data["conclusion"]
    assert data["conclusion"].startswith("On this machine (a --quick run")
    # ... and it follows from the record's own rows: each loop's new DataLoaderX read with
    # plain against itself in the same rounds.
    assert data["conclusion"] == conclude(
        _loops(data["results"]), arm="a new DataLoaderX", quick=True
    )


def _loops(rows: list[dict[str, Any]]) -> list[tuple[str, Spread, Spread | None]]:
    """The loops of a bench record's synthetic rows, as its conclusion reads them."""
    spreads: dict[str, dict[str, Spread]] = collections.defaultdict(dict)
    for row in rows:
        label = Case(**row["case"]).label
        spread = Spread(row["speedup"], row["speedup_low"], row["speedup_high"], row["speedups"])
        spreads[label][row["arm"]] = spread
    return [(label, arms["prefetchx"], arms.get("again")) for label, arms in spreads.items()]


def test_a_full_run_explains_its_jpeg_rows_and_concludes_on_them_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("PIL")
    # The full run's code, on a grid of one case and a JPEG workload of 2 batches.
    monkeypatch.setattr(cli, "DEFAULT_GRID", [Case("sleep", 1, 1, 6)])
    monkeypatch.setattr(cli, "JPEG_IMAGES", 8)
    monkeypatch.setattr(cli, "JPEG_BATCH", 4)
    monkeypatch.setattr(cli, "JPEG_WORKERS", (0,))
    out = tmp_path / "bench.json"
    assert main(["bench", "--cpu-only", "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    data = json.loads(out.read_text())
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)  # the default and 1
    assert [(r["torch_threads"], r["num_workers"]) for r in data["jpeg"]] == [
        (t, 0) for t in threads
    ]
    for row in data["jpeg"]:
        assert set(row["ratios"]) == {"plain", "again", "recipe", "prefetchx"}
        assert len(row["ratios"]["prefetchx"]["rounds"]) == 5
    assert "recipe vs plain" in shown
    assert "prefetchx vs plain" in shown
    flat = " ".join(shown.split())
    assert "Every arm normalizes in its collate_fn, with DataLoaderX's own normalization" in flat
    assert f" of {1 + len(threads)} loops" in data["conclusion"]  # the synthetic case and JPEG
    assert " ".join(shown.strip().split("\n\n")[-1].split()) == data["conclusion"]


def test_meta_names_the_commit_of_a_checkout_or_of_a_copied_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREFETCHX_COMMIT", "abc1234")
    run = subprocess.run  # platform calls it too
    git_answer: str | None = "fed4321\n"

    def git(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if args[0] != "git":
            return run(args, **kwargs)
        if git_answer is None:
            raise subprocess.CalledProcessError(128, args)
        return subprocess.CompletedProcess(args, 0, stdout=git_answer)

    monkeypatch.setattr(subprocess, "run", git)
    # The name given comes first: a copied tree's .git can be older than its files.
    assert machine_meta()["commit"] == "abc1234"
    monkeypatch.delenv("PREFETCHX_COMMIT")
    assert machine_meta()["commit"] == "fed4321"
    git_answer = None
    assert machine_meta()["commit"] == "unknown"


def test_bench_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    assert main(["bench", "--quick", "--cpu-only", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jpeg_workload_runs_every_arm_in_paired_rounds() -> None:
    pytest.importorskip("PIL")
    from prefetchx.bench.jpeg import measure_jpeg

    before = torch.get_num_threads()
    result = measure_jpeg(0, torch_threads=1, images=8, batch_size=4)
    assert torch.get_num_threads() == before  # restored
    assert (result.torch_threads, result.num_workers, result.batches) == (1, 0, 2)
    assert set(result.ratios) == {"plain", "recipe", "prefetchx"}
    assert all(len(times) == 5 for times in result.epochs_s.values())
    assert result.spread("plain").rounds == [1.0] * 5
    assert result.speedup == result.ratios["prefetchx"]["median"]
    assert result.verdict
    assert result.label == "JPEG, 1 torch thread, 0 workers"


def test_jpeg_arms_normalize_alike_and_stop_their_persistent_workers() -> None:
    pytest.importorskip("PIL")
    from prefetchx import DataLoaderX, fast_collate
    from prefetchx.bench.jpeg import (
        CROP,
        MEAN,
        STD,
        JpegDataset,
        NormalizingCollate,
        jpeg_files,
        measure_jpeg,
    )

    with jpeg_files(4) as paths:
        dataset = JpegDataset(paths)
        image, label = dataset[1]
        assert image.shape == (CROP, CROP, 3)
        assert label == 1
        # Every arm's collate_fn: DataLoaderX's own normalization, bit for bit.
        ours = DataLoaderX(dataset, batch_size=2, collate_fn=fast_collate, mean=MEAN, std=STD)
        collate = NormalizingCollate()
        for (x, y), (want, want_y) in zip(
            torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collate),
            ours,
            strict=True,
        ):
            assert x.dtype == torch.float32
            assert torch.equal(x, want)
            assert torch.equal(y, want_y)
        result = measure_jpeg(1, images=4, batch_size=2, arms=("plain", "floor"), paths=paths)
    assert set(result.ratios) == {"plain", "floor"}
    # The shared fixture fails this test if a persistent worker is left running.


def test_the_floor_arm_hands_over_every_item_and_every_error() -> None:
    items = RunAhead(torch.utils.data.DataLoader(Squares(5), batch_size=None))
    assert [int(x[0]) for x in items] == [0, 1, 2, 3, 4]
    failing = RunAhead(torch.utils.data.DataLoader(Squares(5, fail_at=3), batch_size=None))
    got = []
    with pytest.raises(ValueError, match="boom at index 3"):
        for x in failing:
            got.append(int(x[0]))
    assert got == [0, 1, 2]
    assert not [t for t in threading.enumerate() if t.name == "bench-run-ahead"]


def test_release_stops_persistent_workers_of_every_kind_of_arm() -> None:
    from prefetchx.bench.synthetic import ARMS

    kwargs = {"batch_size": None, "num_workers": 1, "persistent_workers": True}
    for arm in ("plain", "recipe", "prefetchx", "floor"):
        loader = ARMS[arm](Squares(4), 2, kwargs)
        assert len(list(loader)) == 4
        release(loader)
        release(loader)  # idempotent
    # The shared fixture fails this test if a worker is left running.


def test_dataloaderx_arms_stay_on_the_cpu_where_there_is_a_gpu() -> None:
    # The synthetic and JPEG loops compare CPU loops; device=None would mean the GPU on a machine
    # with one, where the other arms make no copy (0.06x on an H100 before this was set).
    from prefetchx.bench.synthetic import ARMS

    for arm in ("prefetchx", "inline"):
        loader = ARMS[arm](Squares(4), 2, {"batch_size": 2})
        assert isinstance(loader, DataLoaderX)
        assert loader.device == "cpu"


@pytest.mark.parametrize("kind", ["numpy", "python"])
@pytest.mark.parametrize(
    ("ms", "size", "reps"),
    [
        (2.0, -1, 2),  # the largest unit, twice
        (0.02, 0, 2),  # 20 us: the smallest unit, whose one call is at most half of it
    ],
)
def test_work_takes_the_largest_unit_at_most_half_its_cost(
    kind: str, ms: float, size: int, reps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The calibration read on a clock of our own: each unit costs 1 ms at the largest size and
    # 10x less at each smaller one, so the choice follows from these numbers, not the machine.
    units = UNITS[kind]
    cost = {u: 1e-3 / 10 ** (len(units) - 1 - i) for i, u in enumerate(units)}
    monkeypatch.setattr(Work, "_time_unit", lambda self: cost[self.size])
    work = Work(kind, ms)
    assert (work.size, work.reps) == (units[size], reps)
    with pytest.raises(ValueError, match="`kind` must be one of"):
        Work("gpu", 1.0)


def test_work_times_each_call() -> None:
    for kind in ("sleep", "numpy", "python"):
        work = Work(kind, 0.02)
        for _ in range(3):
            work()
        assert len(work.calls) == 3
        assert work.spent == sum(work.calls)
        work.calls.clear()
        assert work.spent == 0.0
    nothing = Work("python", 0)
    nothing()
    assert nothing.calls == []  # no work: not even a clock read


def test_the_jpeg_workload_without_pillow_names_the_extra_that_brings_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `import PIL` fail
    assert cli._jpeg(argparse.Namespace(max_prefetch=2)) == []
    assert 'skipped: needs pillow (pip install "prefetchx[bench]")' in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--quick", "--plot", str(tmp_path / "x.png")])
    assert exit.value.code == 2  # before the bench ran, not after
    err = capsys.readouterr().err
    assert "argument --plot:" in err
    assert "needs matplotlib" in err
    assert "prefetchx[plot]" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--max-prefetch", "-3"], "argument --max-prefetch: must be >= 1, got -3"),
        (["--max-prefetch", "0"], "argument --max-prefetch: must be >= 1, got 0"),
        (["--max-prefetch", "two"], "argument --max-prefetch: must be an integer >= 1, got 'two'"),
        (["--max-prefetch", "1.5"], "argument --max-prefetch: must be an integer >= 1, got '1.5'"),
        (["--json", "{tmp}/missing/b.json"], "argument --json: the directory of '{tmp}/missing/"),
        (["--json", "{tmp}"], "argument --json: '{tmp}' is a directory"),
        (["--plot", "{tmp}/missing/b.png"], "argument --plot: the directory of '{tmp}/missing/"),
        (["--plot", "{tmp}/b.txt"], "argument --plot: '{tmp}/b.txt' names no image format"),
        (["--quick=yes"], "argument --quick: ignored explicit argument 'yes'"),
        (["--rounds", "3"], "unrecognized arguments: --rounds 3"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_option_and_value(
    argv: list[str], shown: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if any(arg.startswith("--plot") for arg in argv):
        pytest.importorskip("matplotlib")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    with pytest.raises(SystemExit) as exit:
        main(["bench", *argv])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: prefetchx"), err
    assert shown.replace("{tmp}", str(tmp_path)) in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing was written


def test_a_bad_value_from_the_shell_prints_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefetchx", "bench", "--max-prefetch", "-3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "argument --max-prefetch: must be >= 1, got -3" in done.stderr
    assert done.stdout == ""


@needs_records
def test_the_plot_of_the_recorded_run_has_no_text_overlapping() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    from prefetchx.bench import plot

    run = json.loads(RECORDED.read_text())
    fig = plot.figure(run)
    FigureCanvasAgg(fig).draw()
    assert run["meta"]["commit"] in fig.get_suptitle()
    assert "whiskers: the lowest and highest round" in fig.get_suptitle()  # a paired run
    (suptitle,) = [t for t in fig.findobj(Text) if t.get_text() == fig.get_suptitle()]
    heads = [suptitle.get_window_extent()] + [ax.title.get_window_extent() for ax in fig.axes]
    for i, head in enumerate(heads):
        assert not any(head.overlaps(other) for other in heads[i + 1 :]), "titles overlap"
    texts = [suptitle]
    for ax, cases in zip(fig.axes, (6, 4), strict=True):
        labels = [t for t in ax.get_xticklabels() if t.get_text()]
        assert len(labels) == cases
        boxes = [t.get_window_extent() for t in labels]
        for left, right in itertools.pairwise(boxes):
            assert left.x1 < right.x0, f"{ax.get_title()!r}: tick labels overlap"
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *labels]
    for text in texts:
        box = text.get_window_extent()
        assert fig.bbox.contains(box.x0, box.y0), text.get_text()  # not cut off
        assert fig.bbox.contains(box.x1, box.y1), text.get_text()


@needs_records
def test_the_plot_says_the_runs_conclusion_and_shows_the_rounds_spread() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from prefetchx.bench import plot

    run = json.loads(RECORDED.read_text())  # the shape of a record, with paired figures added
    for row in run["results"]:
        row.update(speedup_low=row["speedup"] * 0.9, speedup_high=row["speedup"] * 1.1)
    for row in run["jpeg"]:
        row["ratios"] = {
            arm: {"median": 1.0, "low": 0.9, "high": 1.2}
            for arm in ("plain", "recipe", "prefetchx")
        }
    run["conclusion"] = conclude([("sleep 5/5 ms", Spread.of([1.9, 1.8, 2.0]))])
    fig = plot.figure(run)
    FigureCanvasAgg(fig).draw()
    assert "bars: median of the paired rounds" in fig.get_suptitle()
    label = fig._supxlabel  # the conclusion, under the panels
    assert label is not None
    assert " ".join(label.get_text().split()) == run["conclusion"]
    box = label.get_window_extent()
    assert fig.bbox.contains(box.x0, box.y0)
    assert fig.bbox.contains(box.x1, box.y1)
    for ax in fig.axes:
        bars = [c for c in ax.containers if getattr(c, "errorbar", None) is not None]
        assert bars, ax.get_title()  # whiskers: the lowest and highest round
        # plain is the line; the synthetic panel shows the warmed loader beside the new one
        assert {c.get_label() for c in bars} <= {"recipe", "prefetchx", "warmed"}


@needs_records
def test_benchmarks_plot_redraws_a_recorded_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = subprocess.run(
        [sys.executable, "benchmarks/plot.py", str(RECORDED), str(tmp_path / "a.png")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
