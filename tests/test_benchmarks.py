"""The benchmark programs of issue #16 (``benchmarks/grid.py``, ``jpeg_pipeline.py``,
``no_work.py``, ``kept_alone.py`` and ``mode_trace.py``) and #63's ``resume_fuzz.py``: their quick
runs write a table and a JSON record of the expected shape; the full grid's cells."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARMS = {"plain", "prefetchx", "recipe", "inline", "floor"}
GRID_ARMS = {*ARMS, "again", "recipe again"}


def _program(name: str) -> ModuleType:
    qualified = f"benchmarks_{name}"
    spec = importlib.util.spec_from_file_location(qualified, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(program: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, f"benchmarks/{program}.py", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _recorded(
    stem: Path, done: subprocess.CompletedProcess[str], arms: set[str] = ARMS
) -> tuple[str, dict[str, Any]]:
    """The table and the record a run wrote, checked for what every recorded run must say."""
    assert done.returncode == 0, done.stderr
    text = Path(f"{stem}.txt").read_text()
    record = json.loads(Path(f"{stem}.json").read_text())
    meta = record["meta"]
    for key in ("prefetchx", "commit", "torch", "python", "machine", "cpus"):
        assert meta[key], key
    first = text.splitlines()[0]  # the machine, the versions and the commit
    assert meta["commit"] in first
    assert meta["torch"] in first
    assert meta["machine"] in first
    assert meta["quick"] is True
    # The table ends with the run's conclusion, as does what it printed.
    assert " ".join(text.strip().split("\n\n")[-1].split()) == record["conclusion"]
    assert " ".join(done.stdout.strip().split("\n\n")[-1].split()) == record["conclusion"]
    assert record["conclusion"].startswith("On this machine (a --quick run")
    # Every column and every arm is explained in the table.
    for name in record["columns"]:
        assert f"  {name}: " in text, name
    assert set(record["arms"]) == arms
    for arm in arms:
        assert f"  {arm}: " in text, arm
    return text, record


def _paired(ratios: dict[str, Any], arms: set[str] = ARMS) -> None:
    assert set(ratios) == arms
    for arm, spread in ratios.items():
        assert len(spread["rounds"]) == 5, arm  # paired rounds, at least 5
        assert spread["low"] <= spread["median"] <= spread["high"]
    assert ratios["plain"]["rounds"] == [1.0] * 5


def test_the_quick_no_work_run_takes_the_loops_cost_apart(tmp_path: Path) -> None:
    stem = tmp_path / "no_work"
    arms = {"plain", "source", "stage", "prefetchx", "windows_5ms"}
    arms |= {"generator", "wrapper", "c_level"}  # the floors
    text, record = _recorded(stem, _run("no_work", "--quick", "--out", str(stem)), arms)
    figures = record["figures"]
    _paired({name: f["vs_plain"] for name, f in figures.items()}, arms)
    for name, f in figures.items():
        assert len(f["epochs_s"]) == 5, name
        assert f["us_per_batch"] > 0, name
        assert f"\n{name} " in text, name  # a row of the table
    assert figures["plain"]["above_plain_us"] == 0.0
    # The conclusion quotes DataLoaderX's own figures, as the table shows them.
    ours = figures["prefetchx"]
    assert f"{ours['vs_plain']['median']:.3f}x plain" in record["conclusion"]
    assert f"{ours['above_plain_us']:.2f} us a batch" in record["conclusion"]


def test_no_work_refuses_fewer_rounds_than_a_paired_figure_needs() -> None:
    done = _run("no_work", "--rounds", "3")
    assert done.returncode == 2
    assert "--rounds must be at least 5, got 3" in done.stderr


def test_the_quick_grid_writes_its_table_and_record(tmp_path: Path) -> None:
    text, record = _recorded(
        tmp_path / "grid", _run("grid", "--quick", "--out", str(tmp_path / "grid")), GRID_ARMS
    )
    cells = record["cells"]
    assert {c["kind"] for c in cells} == {"none", "sleep", "python"}
    assert {c["shape"] for c in cells} == {"constant", "bimodal"}
    for cell in cells:
        _paired(cell["ratios"], GRID_ARMS)
        assert set(cell["epochs_s"]) == GRID_ARMS
        assert cell["batches"] >= 20
        assert cell["label"] in text or cell["kind"] in text
    summary = record["summary"]
    assert summary["worst"]["cell"] in {c["label"] for c in cells}
    assert summary["no_work"]["cell"] == "none, D 0 us, C 0 us, 0 workers"
    handoff = record["handoff"]
    assert set(handoff["extra_us_per_batch"]) == {"plain", "thread", "handed over", "floor"}
    assert handoff["switches_per_batch"]["thread"] >= 0
    assert set(handoff["depths"]) == {"4", "8", "32"}
    grid = _program("grid")
    read = [grid.settled(c) for c in cells]  # from the second look where a cell had one
    noise = summary["noise"]
    assert noise["cell"] in {c["label"] for c in cells}
    assert noise["median"] == min(c["ratios"]["again"]["median"] for c in read)
    assert noise["prefetchx_below_0.97"] == sum(
        1 for c in read if c["ratios"]["prefetchx"]["median"] < 0.97
    )
    for line in (
        "worst cell: ",
        "noise: plain against itself ",
        "no-work loop: ",
        "winning cells: ",
        "hand-off: the thread stage",
        "hand-off, deeper queues, over the floor's: max_prefetch=4 ",
    ):
        assert f"\n  {line}" in text, line
    assert "every batch handed over: " in " ".join(text.split())
    # Exactly the cells near a target were measured again, in the arms the targets read.
    looked = [c for c in cells if "second_look" in c]
    assert looked == [c for c in cells if grid.second_look_due(c)]
    assert summary["second_look"]["cells"] == len(looked)
    assert record["meta"]["second_rounds"] == summary["second_look"]["rounds"] == 5
    for cell in looked:
        _paired(cell["second_look"]["ratios"], set(grid.SECOND_LOOK_ARMS))
        assert cell["label"] in text  # a row of the second look's table
    assert "\n  second look: " in text


def test_the_grid_runs_only_the_cells_its_pattern_names(tmp_path: Path) -> None:
    stem = tmp_path / "grid"
    only = "^sleep, D 200 us"
    done = _run("grid", "--quick", "--only", only, "--second-rounds", "0", "--out", str(stem))
    text, record = _recorded(stem, done, GRID_ARMS)
    assert [c["label"] for c in record["cells"]] == ["sleep, D 200 us, C 200 us, 0 workers"]
    assert record["meta"]["only"] == only
    assert record["summary"]["no_work"] is None  # not among the cells run
    assert re.search(r"no-work loop: [\d.]+x", text) is None  # no figure, only its legend
    assert "hand-off: the thread stage" in text


@pytest.mark.parametrize(
    ("only", "says"),
    [
        ("^zzz", "--only matches no cell's label: '^zzz'"),
        ("ramp(", "argument --only: not a regular expression"),
    ],
)
def test_the_grid_refuses_a_pattern_that_runs_nothing(only: str, says: str) -> None:
    done = _run("grid", "--quick", "--only", only)
    assert done.returncode == 2
    assert says in done.stderr
    assert "cell 1/" not in done.stderr  # refused before any cell ran


def _cell(
    label: str, ours: float, recipe: float = 1.0, again: float = 1.0, twin: float | None = None
) -> dict[str, Any]:
    figures = {"plain": 1.0, "prefetchx": ours, "recipe": recipe, "again": again}
    if twin is not None:  # the second recipe; records before it have none
        figures["recipe again"] = twin
    return {
        "label": label,
        "kind": "sleep",
        "workers": 0,
        "ratios": {
            arm: {"median": m, "low": m, "high": m, "rounds": [m] * 5} for arm, m in figures.items()
        },
    }


def _handoff() -> dict[str, Any]:
    """A hand-off measurement, as the grid's summary reads it."""
    return {
        "extra_us_per_batch": {"thread": 20.0, "floor": 10.0, "handed over": 30.0},
        "switches_per_batch": {"thread": 1.0, "floor": 1.0, "handed over": 2.0},
        "thread_over_floor": 2.0,
        "handed_over_over_floor": 3.0,
        "depths": {},
    }


def test_the_grid_reads_a_cell_near_a_target_from_its_second_look() -> None:
    grid = _program("grid")
    near = _cell("near", 0.975)
    behind = _cell("behind the recipe", 1.2, recipe=1.25)  # 0.96 of the best
    clear = _cell("clear", 0.99)
    winning = _cell("winning", 1.3, recipe=1.3)
    assert [grid.second_look_due(c) for c in (near, behind, clear, winning)] == [
        True,
        True,
        False,
        False,
    ]
    near["second_look"] = {"ratios": _cell("near", 1.01, again=0.95)["ratios"]}
    behind["second_look"] = {"ratios": _cell("behind", 1.1, recipe=1.3)["ratios"]}
    handoff = _handoff()
    summary = grid.summarize([near, behind, clear, winning], handoff, 11)
    # Read from the second look: "near" no longer the worst, "behind" further behind.
    assert summary["worst"]["cell"] == "clear"
    assert summary["noise"]["cell"] == "near"  # its second look's plain against itself
    assert summary["winning_worst"]["cell"] == "behind the recipe"
    assert summary["winning_worst"]["of_best"] == pytest.approx(1.1 / 1.3)
    # ... and from the first look alone, as it read there.
    first = summary["second_look"]["first_look"]
    assert first["worst"]["cell"] == "near"
    assert first["winning_worst"]["of_best"] == pytest.approx(1.2 / 1.25)
    assert summary["second_look"]["cells"] == 2
    text = grid.format_summary({**summary, "no_work": None})
    assert (
        "second look: 2 cells, 11 rounds each; at the first look alone, the worst cell 0.97x"
        in (" ".join(text.split()))
    )


def test_the_grid_reads_the_winning_cells_target_for_the_recipe_against_itself() -> None:
    grid = _program("grid")
    cells = [
        _cell("a", 1.25, recipe=1.30, twin=1.24),  # DataLoaderX 0.962, the twin 0.954
        _cell("b", 1.10, recipe=1.10, twin=1.08),  # 1.000 and 0.982
        _cell("c", 0.99, recipe=1.01, twin=0.90),  # not a winning cell: the twin not read
    ]
    handoff = _handoff()
    # A winning cell is measured again where either arm reads near the line: "b" for its twin.
    assert [grid.second_look_due(c) for c in cells] == [True, False, False]
    cells[1]["ratios"]["recipe again"]["median"] = 1.07  # 0.973
    assert grid.second_look_due(cells[1])
    cells[1]["ratios"]["recipe again"]["median"] = 1.08
    summary = grid.summarize(cells, handoff)
    twin = summary["winning_noise"]
    assert twin["cell"] == "a"
    assert twin["of_best"] == pytest.approx(1.24 / 1.30)
    assert (twin["below_0.97"], twin["cells"]) == (1, 2)
    assert summary["second_look"]["first_look"]["winning_noise"] == twin
    text = " ".join(grid.format_summary({**summary, "no_work": None}).split())
    assert (
        "0.962 of the best of plain and the recipe (a); 1 below 0.97; the recipe against " in text
    )
    assert "itself 0.954 at the lowest (a), 1 below 0.97" in text
    # A record from before the second recipe reads as it did.
    for c in cells:
        del c["ratios"]["recipe again"]
    before = grid.summarize(cells, handoff)
    assert before["winning_noise"] is None
    assert "; the recipe against itself" not in grid.format_summary({**before, "no_work": None})


def test_the_grid_holds_a_winning_cell_to_the_recipe_round_by_round() -> None:
    # The two arms' medians over plain come from different rounds: here they read 1.10 and
    # 1.25, 0.88 apart, while DataLoaderX matched the recipe's epoch in every round.
    grid = _program("grid")
    recipe_epochs = [0.80, 0.90, 0.70, 0.85, 0.75]
    cell = _cell("level", 1.10, recipe=1.25, twin=1.25)
    cell["epochs_s"] = {
        "plain": [1.0] * 5,
        "prefetchx": recipe_epochs,
        "recipe": recipe_epochs,
        "recipe again": [e * 1.01 for e in recipe_epochs],
    }
    assert grid.of_best(cell) == pytest.approx(1.0)
    assert not grid.second_look_due(cell)
    summary = grid.summarize([cell], _handoff())
    assert summary["winning_worst"]["of_best"] == pytest.approx(1.0)
    assert summary["winning_noise"]["of_best"] == pytest.approx(1 / 1.01)
    # Read from its second look, with that look's rounds.
    cell["second_look"] = {
        "ratios": cell["ratios"],
        "epochs_s": {**cell["epochs_s"], "prefetchx": [e * 1.1 for e in recipe_epochs]},
    }
    assert grid.summarize([cell], _handoff())["winning_worst"]["of_best"] == pytest.approx(1 / 1.1)
    # A record without its epochs reads as the ratio of the medians.
    del cell["epochs_s"], cell["second_look"]
    assert grid.of_best(cell) == pytest.approx(1.10 / 1.25)
    assert grid.second_look_due(cell)


def test_the_quick_handoff_alone_measures_the_deeper_queues_too(tmp_path: Path) -> None:
    stem = tmp_path / "handoff"
    done = _run("grid", "--handoff-only", "--quick", "--out", str(stem))
    assert done.returncode == 0, done.stderr
    text = Path(f"{stem}.txt").read_text()
    record = json.loads(Path(f"{stem}.json").read_text())
    assert record["meta"]["handoff_only"] is True
    handoff = record["handoff"]
    assert handoff["max_prefetch"] == 2
    assert set(handoff["extra_us_per_batch"]) == {"plain", "thread", "handed over", "floor"}
    assert set(handoff["depths"]) == {"4", "8", "32"}
    for depth, measured in handoff["depths"].items():
        assert len(handoff["epochs_s"][f"depth {depth}"]) == 5  # paired with plain's rounds
        assert measured["switches_per_batch"] >= 0
        assert f"max_prefetch={depth}: the thread stage " in text
    assert "; handing over every batch, " in text
    assert len(handoff["epochs_s"]["handed over"]) == 5
    assert set(record["summary"]["depths"]) == set(handoff["depths"])
    assert " ".join(text.strip().split("\n\n")[-1].split()) == record["conclusion"]


def test_the_quick_jpeg_pipeline_writes_its_table_and_record(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    stem = tmp_path / "jpeg"
    done = _run("jpeg_pipeline", "--quick", "--out", str(stem))
    text, record = _recorded(stem, done, GRID_ARMS)
    results = record["results"]
    assert [(r["torch_threads"], r["num_workers"]) for r in results] == [(1, 0), (1, 1)]
    for r in results:
        _paired(r["ratios"], GRID_ARMS)
        assert r["verdict"]
        assert r["verdict"] in " ".join(text.split()) or r["verdict"][:40] in text
    summary = record["summary"]
    worst = min(results, key=lambda r: r["ratios"]["prefetchx"]["median"])
    assert summary["worst"]["again"] == worst["ratios"]["again"]
    assert summary["worst"]["configuration"].startswith("JPEG, 1 torch thread")
    assert "; plain against itself " in text
    assert "every arm normalizes in its collate_fn" in " ".join(text.split())


def test_the_jpeg_pipeline_runs_the_configurations_asked_for(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    stem = tmp_path / "jpeg"
    done = _run("jpeg_pipeline", "--quick", "--workers", "1", "--out", str(stem))
    _, record = _recorded(stem, done, GRID_ARMS)
    assert [(r["torch_threads"], r["num_workers"]) for r in record["results"]] == [(1, 1)]


def test_the_jpeg_pipeline_refuses_a_negative_worker_count() -> None:
    done = _run("jpeg_pipeline", "--quick", "--workers", "-1")
    assert done.returncode == 2
    assert "--workers must be >= 0, got -1" in done.stderr


def _jpeg_result(program: ModuleType, workers: int, **medians: float) -> Any:
    """A JPEG configuration whose arms read ``medians`` over plain in every one of 5 rounds."""
    medians = {"plain": 1.0, **medians}
    spreads = {
        arm: {"median": m, "low": m, "high": m, "rounds": [m] * 5} for arm, m in medians.items()
    }
    return program.JpegResult(1, workers, 32, 5, {}, spreads, medians["prefetchx"], "")


def test_the_jpeg_summary_reads_the_noise_and_the_winning_configurations() -> None:
    jpeg = _program("jpeg_pipeline")
    results = [
        _jpeg_result(jpeg, 0, prefetchx=1.20, recipe=1.30, again=0.99, **{"recipe again": 1.27}),
        _jpeg_result(jpeg, 1, prefetchx=0.95, recipe=1.01, again=0.90, **{"recipe again": 0.8}),
        _jpeg_result(jpeg, 2, prefetchx=1.00, recipe=1.05, again=1.02, **{"recipe again": 0.99}),
    ]  # winning: the first (0.923, the twin 0.977) and the last (0.952, 0.943); the middle worst
    summary, text = jpeg.summarize(results)
    text = " ".join(text.split())  # as one line, not wrapped
    assert summary["worst"]["configuration"] == "JPEG, 1 torch thread, 1 worker"
    assert summary["worst"]["median"] == 0.95
    assert summary["worst"]["again"]["median"] == 0.90
    assert summary["noise"]["configuration"] == "JPEG, 1 torch thread, 1 worker"
    assert summary["winning"] == 2
    assert summary["winning_worst"]["configuration"] == "JPEG, 1 torch thread, 0 workers"
    assert summary["winning_worst"]["of_best"] == pytest.approx(1.20 / 1.30)
    assert "DataLoaderX at 0.923 of the recipe (JPEG, 1 torch thread, 0 workers" in text
    assert "plain against itself 0.90x (0.90-0.90) there" in text
    # The recipe against itself, in the winning configurations only.
    assert summary["winning_noise"]["configuration"] == "JPEG, 1 torch thread, 2 workers"
    assert summary["winning_noise"]["of_best"] == pytest.approx(0.99 / 1.05)
    assert (
        "; the recipe against itself 0.943 at the lowest (JPEG, 1 torch thread, 2 workers)" in text
    )
    none, text = jpeg.summarize(results[1:2])
    assert none["winning"] == 0
    assert none["winning_worst"] is None
    assert "winning configurations: none" in text


def test_the_jpeg_summary_holds_a_winning_configuration_to_the_recipe_round_by_round() -> None:
    jpeg = _program("jpeg_pipeline")
    result = _jpeg_result(jpeg, 0, prefetchx=1.10, recipe=1.25, again=1.0)  # 0.88 apart
    recipe_epochs = [0.80, 0.90, 0.70, 0.85, 0.75]
    result.epochs_s.update(
        {
            "plain": [1.0] * 5,
            "recipe": recipe_epochs,
            "prefetchx": [e * 1.02 for e in recipe_epochs],
        }
    )
    summary, text = jpeg.summarize([result])
    assert summary["winning_worst"]["of_best"] == pytest.approx(1 / 1.02)
    assert "DataLoaderX at 0.980 of the recipe" in " ".join(text.split())


@pytest.mark.parametrize("program", ["grid", "jpeg_pipeline"])
@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--rounds", "3"], "argument --rounds: must be >= 5, got 3"),
        (["--rounds", "x"], "argument --rounds: must be an integer >= 5, got 'x'"),
        (["--max-prefetch", "0"], "argument --max-prefetch: must be >= 1, got 0"),
        (["--out", "{tmp}/missing/grid"], "argument --out: the directory of '{tmp}/missing/grid'"),
        (["--out", "{tmp}"], "argument --out: '{tmp}' is a directory"),
    ],
)
def test_a_bad_option_is_a_usage_error_before_anything_runs(
    program: str,
    args: list[str],
    shown: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    main = _program(program).main
    with pytest.raises(SystemExit) as exited:
        main([a.replace("{tmp}", str(tmp_path)) for a in args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert shown.replace("{tmp}", str(tmp_path)) in err
    assert out == ""
    assert not list(tmp_path.iterdir())


def test_the_grids_second_look_takes_enough_rounds_or_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    grid = _program("grid")
    with pytest.raises(SystemExit) as exited:
        grid.main(["--second-rounds", "3"])
    assert exited.value.code == 2
    assert "argument --second-rounds: must be >= 5, got 3" in capsys.readouterr().err
    assert grid.parser().parse_args(["--second-rounds", "0"]).second_rounds == 0
    assert grid.parser().parse_args([]).second_rounds is None  # 11, or 5 --quick


def test_a_second_look_with_workers_times_several_epochs_an_arm_a_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grid = _program("grid")
    assert grid.SECOND_LOOK_EPOCHS[0] == 1
    assert grid.SECOND_LOOK_EPOCHS[2] > 1
    run_epoch = grid.run_epoch
    seconds = iter(range(1, 10_000))
    ran: list[str] = []

    def counted(loader: Any, step: Any) -> float:
        run_epoch(loader, step)
        ran.append(type(loader).__name__)
        return float(next(seconds))  # the clock: each epoch takes 1 s longer than the last

    monkeypatch.setattr(grid, "run_epoch", counted)
    cell = grid.Cell("sleep", 0, 0.0, 0.0, batches=20)
    arms = ("plain", "again")
    record = grid.measure_cell(cell, 5, 2, lambda _: None, arms, epochs=3)
    assert len(ran) == len(arms) * (1 + 5 * 3)  # one untimed epoch each, then 3 a round
    assert record["epochs_per_round"] == 3
    # Each round's time is the sum of three epochs in a row (the untimed ones took 1 and 2 s).
    times = record["epochs_s"]
    assert [len(t) for t in times.values()] == [5, 5]
    assert sorted(t // 3 - 1 for t in times["plain"] + times["again"]) == list(range(3, 31, 3))
    assert all(t % 3 == 0 for t in times["plain"] + times["again"])
    # Per batch over plain, counted over every epoch of the round.
    pairs = zip(times["again"], times["plain"], strict=True)
    per_batch = [(a - p) / (20 * 3) * 1e6 for a, p in pairs]
    assert record["extra_us_per_batch"]["again"] == statistics.median(per_batch)


@pytest.mark.parametrize("program", ["grid", "jpeg_pipeline"])
def test_a_bad_option_from_the_shell_prints_no_traceback(program: str, tmp_path: Path) -> None:
    done = _run(program, "--rounds", "3", "--out", str(tmp_path / "run"))
    assert done.returncode == 2
    assert "argument --rounds: must be >= 5, got 3" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    assert not list(tmp_path.iterdir())


def test_the_full_grid_covers_every_cost_kind_worker_count_and_shape() -> None:
    grid = _program("grid")
    cells = grid.grid(quick=False, epoch_ms=250.0)
    constant = [c for c in cells if c.shape == "constant" and c.kind != "none"]
    assert len(constant) == 3 * 2 * (5 * 5 - 1)  # kinds x workers x (D, C) but (0, 0)
    assert {(c.kind, c.workers) for c in cells if c.kind == "none"} == {("none", 0), ("none", 2)}
    assert {c.data_ms for c in constant} == {0.0, 0.02, 0.2, 2.0, 10.0}
    assert {c.step_ms for c in constant} == {0.0, 0.02, 0.2, 2.0, 10.0}
    shaped = [c for c in cells if c.shape != "constant"]
    assert {(c.kind, c.workers, c.shape) for c in shaped} == {
        (k, w, s) for k in ("sleep", "numpy", "python") for w in (0, 2) for s in grid.SHAPES
    }
    for cell in cells:
        assert 20 <= cell.batches <= 20000
        assert len(cell.steps_ms()) == cell.batches
    bimodal = next(c for c in shaped if c.shape == "bimodal").steps_ms()
    assert set(bimodal) == {0.02, 2.0}
    phases = next(c for c in shaped if c.shape == "phases").steps_ms()
    assert phases[:64] == [0.02] * 64
    assert phases[64:128] == [2.0] * 64
    ramp = next(c for c in shaped if c.shape == "ramp").steps_ms()
    assert ramp == sorted(ramp)
    assert (ramp[0], ramp[-1]) == (0.0, 2.0)
    # Epochs are sized by cost: a no-work loop gets many batches, a 10 + 10 ms one few.
    by_cost = {(c.kind, c.workers, c.data_ms, c.step_ms): c.batches for c in constant}
    assert by_cost[("sleep", 0, 0.0, 0.02)] > by_cost[("sleep", 0, 10.0, 10.0)] == 20
    # ... and by what a DataLoader costs a batch on the machine, measured.
    slow = grid.grid(quick=False, epoch_ms=250.0, overhead_ms={0: 0.03, 2: 1.0})
    none = {c.workers: c.batches for c in slow if c.kind == "none"}
    assert none == {0: round(250 / 0.03), 2: 250}


def test_the_grid_measures_a_dataloaders_own_cost_per_batch() -> None:
    grid = _program("grid")
    assert 0 < grid.loader_overhead_ms(0, batches=50) < 50.0


def test_the_quick_kept_alone_run_counts_the_epochs_each_chooser_kept_the_loop_alone(
    tmp_path: Path,
) -> None:
    # The chooser of --before never tries the thread (nothing is worth hiding to it), so it
    # keeps the loop alone in every epoch: what the program counts comes from that chooser.
    source = (ROOT / "prefetchx" / "_adapt.py").read_text()
    assert "\nHIDE_AT_LEAST_S = 10e-6\n" in source
    never = tmp_path / "never.py"
    never.write_text(source.replace("\nHIDE_AT_LEAST_S = 10e-6\n", "\nHIDE_AT_LEAST_S = 1e9\n"))
    stem = tmp_path / "kept"
    done = _run("kept_alone", "--quick", "--before", str(never), "--out", str(stem))
    assert done.returncode == 0, done.stderr
    text = Path(f"{stem}.txt").read_text()
    record = json.loads(Path(f"{stem}.json").read_text())
    meta = record["meta"]
    assert meta["commit"] in text.splitlines()[0]
    assert (meta["runs"], meta["epochs"]) == (2, 3)
    assert len(record["runs"]) == 2
    for run in record["runs"]:
        assert set(run["epochs_s"]) == {"plain", "prefetchx", "thread", "before"}
        assert all(len(times) == 3 for times in run["epochs_s"].values())
        assert run["alone"]["before"] == [True] * 3
    figures = record["figures"]
    before, ours = figures["before"], figures["prefetchx"]
    assert (before["alone_epochs"], before["epochs"]) == (4, 4)  # the first of each run left out
    assert (before["alone_runs"], before["runs"]) == (0, 2)  # 2 counted epochs: under 4 in a row
    assert 0 <= ours["alone_epochs"] <= ours["epochs"] == 4
    assert "alone_epochs" not in figures["thread"]
    for arm in ("plain", "prefetchx", "thread", "before"):
        assert f"\n{arm} " in text
    assert figures["plain"]["vs_plain_median"] == 1.0
    assert f"{ours['alone_epochs']} of 4 epochs" in record["conclusion"]
    assert record["conclusion"] in text


@pytest.mark.parametrize(
    ("shape", "cell"),
    [
        ("python", "python, D 5000 us, C 5000 us, 0 workers"),
        ("workers", "numpy, D 20 us, C 20 us, 2 workers"),
    ],
)
def test_kept_alone_counts_the_thread_kept_where_the_loop_alone_is_faster(
    shape: str, cell: str, tmp_path: Path
) -> None:
    # The pure-Python loop, and the grid's worst cell with its workers: there the loop alone is
    # the faster mode, so the slower one counted is the thread. The chooser of --before never
    # tries the thread: it kept it in no epoch.
    source = (ROOT / "prefetchx" / "_adapt.py").read_text()
    never = tmp_path / "never.py"
    never.write_text(source.replace("\nHIDE_AT_LEAST_S = 10e-6\n", "\nHIDE_AT_LEAST_S = 1e9\n"))
    stem = tmp_path / "kept"
    args = ("--quick", "--shape", shape, "--no-thread", "--before", str(never))
    done = _run("kept_alone", *args, "--out", str(stem))
    assert done.returncode == 0, done.stderr
    text = Path(f"{stem}.txt").read_text()
    record = json.loads(Path(f"{stem}.json").read_text())
    assert record["cell"].startswith(cell)
    before, ours = record["figures"]["before"], record["figures"]["prefetchx"]
    assert (before["thread_epochs"], before["alone_epochs"], before["thread_runs"]) == (0, 4, 0)
    for figures in (before, ours):
        assert figures["thread_epochs"] + figures["alone_epochs"] == figures["epochs"] == 4
    assert "  thread kept\n" in text
    assert f"DataLoaderX kept the thread in {ours['thread_epochs']} of 4 epochs" in text
    assert "The chooser of --before: 0 of 4 epochs, 0 of 2 runs" in record["conclusion"]


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--epochs", "1"], "argument --epochs: must be >= 2, got 1"),
        (["--before", "{tmp}/missing.py"], "--before: no file '{tmp}/missing.py'"),
        (["--before", "{tmp}/empty.py"], "'{tmp}/empty.py' has no Chooser or Memory"),
        (["--workers", "-1"], "argument --workers: must be >= 0, got -1"),
        (["--workers", "two"], "argument --workers: must be an integer >= 0, got 'two'"),
        (["--shape", "python", "--workers", "2"], "--workers is for the shaped numpy loops"),
        (["--cell", "jpeg,20,200"], "argument --cell: expected KIND,D,C with KIND one of"),
        (["--cell", "python,20"], "argument --cell: expected KIND,D,C"),
        (["--cell", "python,x,200"], "argument --cell: D and C must be numbers of us"),
        (["--cell", "python,-1,200"], "argument --cell: D and C must be 0 or more"),
        (["--cell", "python,20,200", "--no-thread"], "--cell reads the loop's slower mode"),
    ],
)
def test_kept_alone_refuses_a_bad_option_before_anything_runs(
    args: list[str], shown: str, tmp_path: Path
) -> None:
    (tmp_path / "empty.py").write_text("")
    done = _run("kept_alone", *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert done.returncode == 2
    assert shown.replace("{tmp}", str(tmp_path)) in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("workers", [0, 2])
def test_kept_alone_runs_a_shaped_loop_with_the_workers_asked_for(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The grid's numpy phases with 2 workers: where the workers take every CPU of the 2-core VM.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    kept = _program("kept_alone")
    cell = kept.the_loop("phases", 20.0, workers)
    assert (cell.kind, cell.workers, cell.shape) == ("numpy", workers, "phases")
    assert cell.label.endswith(f"{workers} workers")


def test_kept_alone_runs_one_cell_of_the_grid_beside_the_recipe(tmp_path: Path) -> None:
    # A sleep loop of 200 us of data and of step: the thread hides the data, so the slower mode
    # read from the run is the loop alone. The recipe runs in every epoch, as the others do.
    stem = tmp_path / "kept"
    args = ("--quick", "--cell", "sleep,200,200", "--recipe", "--out", str(stem))
    done = _run("kept_alone", *args)
    assert done.returncode == 0, done.stderr
    record = json.loads(Path(f"{stem}.json").read_text())
    assert record["cell"].startswith("sleep, D 200 us, C 200 us, 0 workers")
    assert (record["meta"]["shape"], record["meta"]["recipe"]) == ("cell", True)
    assert set(record["figures"]) == {"plain", "prefetchx", "thread", "recipe"}
    assert all(len(run["epochs_s"]["recipe"]) == 3 for run in record["runs"])
    recipe = record["figures"]["recipe"]["vs_plain_median"]
    assert f"and the recipe {recipe:.3f}x." in record["conclusion"]
    thread = record["figures"]["thread"]["vs_plain_median"]
    slower = "loop alone" if thread > 1.0 else "thread"
    assert f"DataLoaderX kept the {slower} in " in record["conclusion"]


def test_a_cell_run_counts_the_mode_its_thread_arm_says_is_slower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    kept = _program("kept_alone")
    won = {"thread": {"vs_plain_median": 1.2}}
    lost = {"thread": {"vs_plain_median": 0.9}}
    assert kept.counted("cell", won).prefix == "alone"
    assert kept.counted("cell", lost).prefix == "thread"
    with pytest.raises(ValueError, match="thread arm"):
        kept.counted("cell", {})


def test_kept_alone_without_the_thread_arm_runs_the_others_alone(tmp_path: Path) -> None:
    stem = tmp_path / "kept"
    done = _run("kept_alone", "--quick", "--no-thread", "--out", str(stem))
    assert done.returncode == 0, done.stderr
    record = json.loads(Path(f"{stem}.json").read_text())
    assert record["meta"]["thread"] is False
    assert set(record["figures"]) == {"plain", "prefetchx"}
    assert all(set(run["epochs_s"]) == {"plain", "prefetchx"} for run in record["runs"])
    assert "thread kept on" not in record["conclusion"]


def test_kept_alone_gives_its_two_choosers_every_place_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Over as many runs as the design's cycle, DataLoaderX and the --before copy each run in
    # each place of an epoch, and right after their own last epoch, equally often. Reversing
    # the order at every other epoch ran --before twice in a row at every other epoch's end,
    # and DataLoaderX never.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    kept = _program("kept_alone")
    before = kept.load_chooser(str(ROOT / "prefetchx" / "_adapt.py"))
    order: list[str] = []

    def run_epoch(loader: Any, steps: Any) -> float:
        memory = getattr(getattr(loader, "_pipeline", None), "memory", None)
        if memory is None:
            order.append("plain")
        else:
            order.append("before" if type(memory).__module__ == before.__name__ else "prefetchx")
        return 1.0

    monkeypatch.setattr(kept, "run_epoch", run_epoch)
    cell = kept.the_loop(kept.PYTHON, 20.0)
    epochs = 6
    for run in range(6):
        kept.one_run(cell, epochs, before, thread=False, start=run)
    rounds = [order[i : i + 3] for i in range(0, len(order), 3)]
    assert len(rounds) == 36
    for place in range(3):
        at = [r[place] for r in rounds]
        assert at.count("prefetchx") == at.count("before") == 12
    runs = [rounds[i : i + epochs] for i in range(0, len(rounds), epochs)]
    again = collections.Counter(
        b[0] for run in runs for a, b in itertools.pairwise(run) if a[-1] == b[0]
    )
    assert again["prefetchx"] == again["before"] > 0


def test_the_quick_mode_trace_alternates_the_modes_and_records_every_window(
    tmp_path: Path,
) -> None:
    stem = tmp_path / "trace"
    done = _run("mode_trace", "--quick", "--workers", "0", "--out", str(stem))
    assert done.returncode == 0, done.stderr
    text = Path(f"{stem}.txt").read_text()
    record = json.loads(Path(f"{stem}.json").read_text())
    meta = record["meta"]
    assert meta["commit"] in text.splitlines()[0]
    assert (meta["quick"], meta["block"], meta["workers"]) == (True, 4, 0)
    windows = record["windows"]
    measured = [w for w in windows if not w[2]]
    # The modes alternate: each run of measured windows of one mode is the block, 4 windows,
    # and a settling window of the mode's own length opens every run but the first.
    runs = [list(group) for _, group in itertools.groupby(measured, key=lambda w: w[1])]
    assert len(runs) >= 4
    assert {len(run) for run in runs[1:-1]} == {4}
    assert {w[1] for w in measured} == {True, False}
    settling = [w for w in windows if w[2]]
    assert settling
    assert {w[3] for w in settling if w[1]} == {4}  # SETTLE
    assert {w[3] for w in settling if not w[1]} <= {1}  # SETTLE_INLINE
    figures = record["figures"]
    assert figures["block_windows"] == 4
    assert [row["place"] for row in figures["places"]] == [0, 1, 2, 3]
    assert figures["first"] > 0
    assert figures["settled"] > 0
    assert record["conclusion"] in " ".join(text.split())
    assert "(A quick run" in record["conclusion"]


def test_mode_trace_pairs_each_thread_block_with_the_blocks_either_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    trace = _program("mode_trace")
    window = trace.Window
    windows = []
    # The loop alone at 1.0; the thread as fast in its block's first 2 windows, then 1.5: a
    # probe sees the two alike where the thread settles 50% slower (the grid's worst cell).
    for n in range(7):
        threaded = n % 2 == 1
        windows.append(window(0.0, threaded, True, 4 if threaded else 1, 9.0))
        for place in range(4):
            period = (1.0 if place < 2 else 1.5) if threaded else 1.0
            windows.append(window(0.0, threaded, False, 16, period))
    figures = trace.summarize(windows)
    assert figures["blocks"] == 5  # the first and the last left out
    assert figures["first"] == pytest.approx(1.0)
    assert figures["settled"] == pytest.approx(1.5)
    assert figures["places"][0]["thread"] == 1.0
    assert figures["places"][3]["thread"] == 1.5
    assert figures["places"][3]["alone"] == 1.0
    assert "a probe misreads this loop" in trace.conclude(figures, quick=False)
    figures["first"] = 1.45
    assert "a probe reads this loop as it settles" in trace.conclude(figures, quick=False)


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--block", "0"], "argument --block: must be an integer above 0, got '0'"),
        (["--seconds", "-1"], "argument --seconds: must be a number above 0, got '-1'"),
        (["--pin", "--workers", "0"], "--pin places the workers: give --workers 1 or more"),
        (["--data-us", "-20"], "argument --data-us: must be a number >= 0, got '-20'"),
        (["--workers", "two"], "argument --workers: must be an integer >= 0, got 'two'"),
    ],
)
def test_mode_trace_refuses_a_bad_option_before_anything_runs(args: list[str], shown: str) -> None:
    done = _run("mode_trace", *args)
    assert done.returncode == 2
    assert shown in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_the_quick_steal_run_times_the_thread_with_and_without_taking_its_calls(
    tmp_path: Path,
) -> None:
    stem = tmp_path / "steal"
    done = _run("steal", "--quick", "--cell", "sleep,200,200", "--workers", "1", "--out", str(stem))
    assert done.returncode == 0, done.stderr
    text = Path(f"{stem}.txt").read_text()
    record = json.loads(Path(f"{stem}.json").read_text())
    assert record["cell"].startswith("sleep, D 200 us, C 200 us, 1 workers")
    assert set(record["figures"]) == {"plain", "steal", "no steal", "recipe"}
    assert all(len(times) == 3 for times in record["epochs_s"].values())
    assert record["figures"]["plain"] == 1.0
    got = record["figures"]
    assert f"({got['no steal']:.3f}x against {got['steal']:.3f}x plain" in record["conclusion"]
    assert record["conclusion"] in text
    assert text.splitlines()[0].startswith("prefetchx ")


def test_a_steal_run_with_noise_burns_cpus_beside_its_rounds_and_stops_them(
    tmp_path: Path,
) -> None:
    stem = tmp_path / "steal"
    args = ["--quick", "--cell", "sleep,200,200", "--workers", "0", "--noise", "1"]
    # A burner left running would keep the program from exiting: `_run` would time out.
    done = _run("steal", *args, "--out", str(stem))
    assert done.returncode == 0, done.stderr
    record = json.loads(Path(f"{stem}.json").read_text())
    assert record["meta"]["noise"] == 1
    assert "1 processes burning CPUs in bursts beside" in Path(f"{stem}.txt").read_text()


@pytest.mark.parametrize("program", ["steal", "kept_alone"])
def test_any_number_of_workers_sizes_a_cell(program: str, tmp_path: Path) -> None:
    # The grid sizes epochs from its cost of a batch with 0 and with 2 workers only: 3 workers
    # raised KeyError before the first epoch.
    args = ["--quick", "--workers", "3", "--cell", "sleep,20,20"]
    done = _run(program, *args, "--out", str(tmp_path / program))
    assert done.returncode == 0, done.stderr
    assert "3 workers" in json.loads((tmp_path / f"{program}.json").read_text())["cell"]


def test_the_quick_resume_fuzz_compares_every_trial_and_records_it(tmp_path: Path) -> None:
    # benchmarks/resume_fuzz.py (#63): random resume trials, each against DataLoader's
    # uninterrupted run. Every trial that differs must be one whose state counted other than
    # the batches its loop received (#63 item 1, the thread stage's count, fixed apart).
    out = tmp_path / "fuzz.json"
    done = _run("resume_fuzz", "--quick", "--trials", "6", "--seed", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["meta"]["quick"] is True
    assert record["meta"]["commit"]
    summary = record["summary"]
    assert summary["trials"] == len(record["trials"]) == 6
    assert summary["errors"] == 0
    differing = [t for t in record["trials"] if t["differs"]]
    assert summary["differing"] == len(differing)
    assert all(t["item1"] for t in differing), differing
    for name, counts in summary["by_category"].items():
        assert sum(n for n, _ in counts.values()) == 6, name
    assert done.stdout.startswith("6 trials in ")
    assert "category      value" in done.stdout


def test_the_resume_fuzz_refuses_no_trials() -> None:
    done = _run("resume_fuzz", "--trials", "0")
    assert done.returncode == 2
    assert "--trials must be >= 1, got 0" in done.stderr
