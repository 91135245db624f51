"""The `prefetchx bench` command runs and reports every arm."""

from __future__ import annotations

import collections
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetchx import DataLoaderX
from prefetchx.__main__ import main
from prefetchx.bench import cli, synthetic
from prefetchx.bench.paired import CLEAR, Spread, ratios, round_order, run_rounds
from prefetchx.bench.synthetic import (
    COLUMNS,
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
from tests.helpers import Squares

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "bench-cpu-2core.json"


def test_measure_shows_the_thread_overlapping_sleeps() -> None:
    results = {r.arm: r for r in measure(Case("sleep", 10, 10, 12))}
    assert set(results) == {"plain", "recipe", "prefetchx"}
    plain, ours = results["plain"], results["prefetchx"]
    assert plain.speedups == [1.0] * 5  # paired with itself, round by round
    assert len(ours.speedups) == len(ours.epochs_s) == len(ours.bounds_s) == 5
    assert ours.speedup_low <= ours.speedup <= ours.speedup_high
    # Serial is ~240 ms, overlapped ~130 ms. The bound comes from plain's own sleeps in each
    # round, so it holds on a VM whose sleeps overshoot; the speedup bound is loose for that.
    shown = {arm: (r.overlap_efficiency, r.speedup) for arm, r in results.items()}
    assert ours.overlap_efficiency is not None
    assert 0.75 < ours.overlap_efficiency < 1.05, shown
    assert ours.speedup > 1.1, shown
    # Plain's best is plain itself: it gets no prefetcher's bound, no overlap.
    assert (plain.bound_s, plain.overlap_efficiency, plain.per_batch_us) == (None, None, None)
    assert plain.data_call_ms is not None
    assert 9 < plain.data_call_ms < 40  # a 10 ms sleep, as it came out


def test_a_case_with_no_work_has_no_bound() -> None:
    results = measure(Case("sleep", 0, 0, 50, arms=("plain", "prefetchx", "inline", "floor")))
    assert [r.arm for r in results] == ["plain", "prefetchx", "inline", "floor"]
    for r in results:
        assert r.bound_s is None
        assert r.overlap_efficiency is None
        assert len(r.speedups) == 5
    with pytest.raises(ValueError, match="must include 'plain'"):
        measure(Case("sleep", 0, 0, 5, arms=("recipe", "prefetchx")))


@pytest.mark.parametrize("batches", [12, 50, WARM_BATCHES + 1])
def test_each_arm_runs_untimed_epochs_of_warm_batches_before_the_rounds(
    batches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh DataLoaderX spends its first 50 or so batches choosing between its thread and the
    # loop alone; in the bench's loops of 30 to 50 batches, timed from the first epoch, the first
    # two rounds were that choice (numpy 5/5 ms: 1.04x and 1.38x, then 1.9x).
    epochs: collections.Counter[int] = collections.Counter()
    real = synthetic.run_epoch

    def counted(loader: Any, step: Any) -> float:
        epochs[id(loader)] += 1
        return real(loader, step)

    monkeypatch.setattr(synthetic, "run_epoch", counted)
    results = measure(Case("sleep", 0, 0, batches, rounds=5, arms=("plain", "prefetchx")))
    assert len(epochs) == 2
    first, second = epochs.values()
    assert first == second
    warm = first - 5  # the rounds' epochs, one an arm a round
    assert warm * batches >= WARM_BATCHES  # enough untimed batches
    assert warm == 1 or (warm - 1) * batches < WARM_BATCHES  # and no more epochs than that
    assert all(len(r.epochs_s) == 5 for r in results)  # the untimed epochs are not in them


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
    ("rounds", "verdict"),
    [
        ([1.10, 1.05, 1.20, 1.08, 1.12], "faster"),
        ([0.90, 0.95, 0.85, 0.92, 0.93], "slower"),
        ([1.10, 0.99, 1.20, 1.08, 1.12], "same"),  # one round disagrees
        ([1.01, 1.01, 1.015, 1.01, 1.01], "same"),  # every round agrees, by too little
    ],
)
def test_a_spread_says_faster_or_slower_only_when_every_round_agrees(
    rounds: list[float], verdict: str
) -> None:
    assert Spread.of(rounds).verdict == verdict


# --- what the output says -------------------------------------------------------------------------


def _spread(median: float, low: float, high: float) -> Spread:
    return Spread(median, low, high, [low, median, high])


def test_the_conclusion_is_one_sentence_for_each_outcome() -> None:
    faster, slower, same = _spread(1.9, 1.8, 2.0), _spread(0.8, 0.7, 0.9), _spread(1.0, 0.9, 1.1)
    mixed = conclude([("sleep 5/5 ms", faster), ("no work", slower), ("python", same)])
    assert mixed == (
        "On this machine, DataLoaderX was faster than a plain DataLoader in 1 of 3 loops (up "
        "to 1.90x, sleep 5/5 ms) and slower in 1 (down to 0.80x, no work): use it where your "
        "data or step work releases the GIL, and time your own loop against max_prefetch=0 "
        "elsewhere."
    )
    assert conclude([("a", faster), ("b", same)]).endswith("switching costs nothing here.")
    assert conclude([("a", slower), ("b", same)]).endswith(
        "keep the plain DataLoader here unless your own loop, timed, says otherwise."
    )
    assert conclude([("a", same)]).endswith("switching neither gains nor costs here.")
    assert conclude([("a", same)], quick=True).startswith(
        "On this machine (a --quick run, too short to decide from), "
    )
    for sentence in (mixed, conclude([("a", faster)]), conclude([("a", slower)])):
        assert sentence.count(". ") == 0
        assert sentence.endswith(".")


def test_the_conclusion_names_only_loops_it_counted_as_faster_or_slower() -> None:
    # The lowest median (0.80x) and the highest (2.10x) have rounds on both sides of 1.0: the
    # sentence counts neither, so it must not quote them as "up to" or "down to".
    loops = [
        ("sleep 5/5 ms", _spread(1.9, 1.8, 2.0)),
        ("noisy high", _spread(2.1, 0.95, 3.0)),
        ("no work", _spread(0.95, 0.94, 0.98)),
        ("jpeg noisy", _spread(0.8, 0.68, 1.36)),
    ]
    sentence = conclude(loops)
    assert "faster than a plain DataLoader in 1 of 4 loops (up to 1.90x, sleep 5/5 ms)" in sentence
    assert "slower in 1 (down to 0.95x, no work)" in sentence
    only_slower = conclude([("no work", _spread(0.95, 0.94, 0.98)), loops[3]])
    assert "slower in 1 of 2 loops (down to 0.95x, no work)" in only_slower
    only_faster = conclude([loops[0], loops[1], loops[3]])
    assert "in 1 of 3 loops (up to 1.90x, sleep 5/5 ms)" in only_faster
    assert "slower in none for certain (the lowest 0.80x, jpeg noisy," in only_faster


def test_a_median_below_plain_is_never_concluded_to_cost_nothing() -> None:
    # The H200 host's bench (bench-h200-838aba6.txt): no loop slower in every round, but one
    # whose median is 0.87x. "Switching costs nothing here" would be a promise the run broke.
    faster, low = _spread(1.93, 1.76, 1.95), _spread(0.87, 0.80, 1.09)
    sentence = conclude([("sleep 5/5 ms", faster), ("JPEG, 16 torch threads, 0 workers", low)])
    assert "costs nothing" not in sentence
    assert "the lowest 0.87x, JPEG, 16 torch threads, 0 workers, its rounds 0.80x to 1.09x" in (
        sentence
    )
    assert sentence.endswith(
        "time your own loop against max_prefetch=0 where it looks like that one."
    )
    alike = conclude([("a", _spread(1.0, 0.9, 1.1)), ("b", low)])
    assert "neither gains nor costs" not in alike
    assert alike.endswith("time your own loop against max_prefetch=0 before switching.")
    # Within CLEAR of 1.0 the run does say so.
    close = _spread(1.0 - CLEAR, 0.9, 1.1)
    assert conclude([("a", faster), ("b", close)]).endswith("switching costs nothing here.")
    assert conclude([("b", close)]).endswith("switching neither gains nor costs here.")
    for sentence in (conclude([("a", faster), ("b", low)]), alike):
        assert sentence.count(". ") == 0


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
    for arm in ("plain", "recipe", "prefetchx"):
        assert arm in shown
    assert "Columns:" in shown
    data = json.loads(out.read_text())
    assert {row["arm"] for row in data["results"]} == {"plain", "recipe", "prefetchx"}
    assert all(len(row["speedups"]) >= 5 for row in data["results"])
    assert data["meta"]["torch"]
    assert data["jpeg"] == []  # --quick skips the JPEG workload
    # The run ends with its conclusion, the one the record keeps.
    last = shown.strip().split("\n\n")[-1]
    assert " ".join(last.split()) == data["conclusion"]
    assert data["conclusion"].startswith("On this machine (a --quick run")


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
        assert set(row["ratios"]) == {"plain", "recipe", "prefetchx"}
        assert len(row["ratios"]["prefetchx"]["rounds"]) == 5
    assert "recipe vs plain" in shown
    assert "prefetchx vs plain" in shown
    flat = " ".join(shown.split())
    assert "Every arm normalizes in its collate_fn, with DataLoaderX's own normalization" in flat
    assert f" {1 + len(threads)} loops" in data["conclusion"]  # the synthetic case and the JPEG
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


def test_work_kinds_are_calibrated() -> None:
    for kind in ("numpy", "python"):
        work = Work(kind, 2.0)
        start = time.perf_counter()
        work()
        elapsed = time.perf_counter() - start
        assert work.spent == pytest.approx(elapsed, rel=0.5)
        assert 0.0002 < elapsed < 0.1  # about 2 ms, loosely: calibration on a loaded machine
    with pytest.raises(ValueError, match="`kind` must be one of"):
        Work("gpu", 1.0)


def test_short_work_is_made_of_small_units() -> None:
    for kind in ("numpy", "python"):
        work = Work(kind, 0.02)  # 20 us: one unit of a 5 ms work would take far longer
        assert work.size == (1_000 if kind == "numpy" else 20) or work.reps > 1
        for _ in range(20):
            work()
        assert len(work.calls) == 20
        assert statistics.median(work.calls) < 0.002, (kind, work.size, work.reps)
        work.calls.clear()
        assert work.spent == 0.0


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
        assert {c.get_label() for c in bars} <= {"recipe", "prefetchx"}  # plain is the line


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
