"""Draw a bench run's speedups from its record, as ``prefetchx bench --json`` writes it.

``prefetchx bench --plot PATH`` draws the run it has just made; ``benchmarks/plot.py`` draws a
recorded run again, so that a picture follows changes to this drawing without a new run.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ARMS = ("recipe", "prefetchx", "inline", "floor", "warmed")
"""Arms drawn, in this order, where the run has them; plain is the line at 1.0, and plain
against itself (``again``), the noise, is in the record and the table."""


def _case_label(case: Mapping[str, Any]) -> str:
    if case["data_ms"] <= 0 and case["step_ms"] <= 0:
        return f"no work\n{case['batches']} batches"
    return f"{case['kind']}\n{case['data_ms']:g}/{case['step_ms']:g} ms\n{case['batches']} batches"


def _jpeg_ratios(row: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    # A record from before paired rounds has DataLoaderX's median speedup only.
    return dict(row.get("ratios") or {"prefetchx": {"median": row["speedup"]}})


def _bars(axes: Axes, groups: Sequence[Mapping[str, Mapping[str, Any]]]) -> None:
    """One bar per arm in each group at its median, whiskers to the lowest and highest round
    where the record has them."""
    arms = [arm for arm in ARMS if any(arm in group for group in groups)]
    width = 0.8 / max(1, len(arms))
    for k, arm in enumerate(arms):
        points = [(i, group[arm]) for i, group in enumerate(groups) if arm in group]
        xs = [i + (k - (len(arms) - 1) / 2) * width for i, _ in points]
        medians = [p["median"] for _, p in points]
        spread = None
        if all("low" in p for _, p in points):
            spread = [[p["median"] - p["low"] for _, p in points]]
            spread.append([p["high"] - p["median"] for _, p in points])
        color = f"C{ARMS.index(arm)}"  # the same arm in the same colour in every panel
        axes.bar(xs, medians, width, yerr=spread, capsize=2, label=arm, color=color)
    axes.axhline(1.0, color="grey", linewidth=0.8)


def figure(run: Mapping[str, Any]) -> Figure:
    """The speedups of ``run`` over a plain ``DataLoader``, one bar per arm and case.

    Args:
        run: a bench record: ``meta``, ``results`` (the synthetic loop), ``jpeg`` (may be
            empty) and ``conclusion``, as ``prefetchx bench --json`` writes them.

    Returns:
        A matplotlib figure (no pyplot, no backend switch): the synthetic loop on the left,
        the JPEG workload, where the run has it, on the right; each bar is the median of the
        paired rounds, its whisker the lowest and highest round; the run's conclusion below.
    """
    from matplotlib.figure import Figure

    meta, rows, jpeg = run["meta"], run["results"], run.get("jpeg") or []
    cases: list[dict[str, Any]] = []  # in the order the run measured them
    groups: list[dict[str, Mapping[str, Any]]] = []
    for row in rows:
        if row["case"] not in cases:
            cases.append(row["case"])
            groups.append({})
        figures = {"median": row["speedup"]}
        if "speedup_low" in row:  # a record from before paired rounds has medians only
            figures.update(low=row["speedup_low"], high=row["speedup_high"])
        groups[cases.index(row["case"])][row["arm"]] = figures
    fig = Figure(figsize=(13, 5.6) if jpeg else (9, 5.6), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[3, 1]) if jpeg else [fig.subplots()]
    left = axes[0]
    _bars(left, groups)
    left.set_xticks(range(len(cases)), [_case_label(c) for c in cases])
    left.set_ylabel("throughput over plain DataLoader")
    left.set_title("Synthetic loop (data/step ms per batch)")
    left.legend(loc="upper right")  # the no-work cases on the right stay near 1x
    if jpeg:
        right = axes[1]
        _bars(right, [_jpeg_ratios(r) for r in jpeg])
        right.set_xticks(
            range(len(jpeg)),
            [f"{r['torch_threads']} thr.\n{r['num_workers']} wkr." for r in jpeg],
        )
        right.set_xlabel("torch threads, DataLoader workers")
        right.set_title("JPEG + conv net (CPU),\nover plain")
    paired = all("speedup_low" in row for row in rows)
    fig.suptitle(
        f"prefetchx {meta['prefetchx']} at {meta['commit']}, torch {meta['torch']}, "
        f"Python {meta['python']}, {meta['cpus']} CPUs\n"
        + (
            "bars: median of the paired rounds, whiskers: the lowest and highest round"
            if paired
            else "bars: medians of rounds (recorded before paired rounds)"
        )
    )
    if run.get("conclusion"):
        fig.supxlabel(textwrap.fill(run["conclusion"], 150 if jpeg else 105), fontsize="medium")
    return fig


def save(run: Mapping[str, Any], path: str) -> None:
    """Draw ``run`` (see `figure`) into the image file ``path``; its suffix picks the format."""
    figure(run).savefig(path, dpi=110)
