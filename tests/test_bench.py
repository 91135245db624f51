"""The `prefetchx bench` command runs and reports every arm."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prefetchx.__main__ import main
from prefetchx.bench.synthetic import Case, Work, machine_meta, measure

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "bench-cpu-2core.json"


def test_measure_shows_the_thread_overlapping_sleeps() -> None:
    results = {r.arm: r for r in measure(Case("sleep", 10, 10, 12, rounds=3))}
    assert set(results) == {"plain", "recipe", "prefetchx"}
    assert results["plain"].speedup == pytest.approx(1.0)
    # Serial is ~240 ms, overlapped ~130 ms. Efficiency compares each epoch with its own sleeps,
    # so it holds on a VM whose sleeps overshoot; the speedup bound is loose for that reason.
    shown = {arm: (r.overlap_efficiency, r.speedup) for arm, r in results.items()}
    assert results["prefetchx"].overlap_efficiency > 0.75, shown
    assert results["plain"].overlap_efficiency < 0.6, shown
    assert results["prefetchx"].speedup > 1.1, shown


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


def test_bench_quick_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for arm in ("plain", "recipe", "prefetchx"):
        assert arm in table
    data = json.loads(out.read_text())
    assert {row["arm"] for row in data["results"]} == {"plain", "recipe", "prefetchx"}
    assert data["meta"]["torch"]
    assert data["jpeg"] == []  # --quick skips the JPEG workload


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
    assert machine_meta()["commit"] == "fed4321"  # git's answer comes first
    git_answer = None
    assert machine_meta()["commit"] == "abc1234"
    monkeypatch.delenv("PREFETCHX_COMMIT")
    assert machine_meta()["commit"] == "unknown"


def test_bench_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    assert main(["bench", "--quick", "--cpu-only", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jpeg_workload_runs_both_arms() -> None:
    pytest.importorskip("PIL")
    from prefetchx.bench.jpeg import measure_jpeg

    result = measure_jpeg(0, images=8, batch_size=4, rounds=1)
    assert result.batches == 2
    assert result.plain_s > 0
    assert result.prefetchx_s > 0
    assert result.verdict


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
