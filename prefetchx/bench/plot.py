"""Draw a bench run's speedups from its record, as ``prefetchx bench --json`` writes it.

``prefetchx bench --plot PATH`` draws the run it has just made; ``benchmarks/plot.py`` draws a
recorded run again, so that a picture follows changes to this drawing without a new run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ARMS = ("plain", "recipe", "prefetchx")


def figure(run: Mapping[str, Any]) -> Figure:
    """The speedups of ``run`` over a plain ``DataLoader``, one bar per arm and case.

    Args:
        run: a bench record: ``meta``, ``results`` (the synthetic loop) and ``jpeg`` (may be
            empty), as ``prefetchx bench --json`` writes them.

    Returns:
        A matplotlib figure (no pyplot, no backend switch): the synthetic loop on the left,
        the JPEG workload, where the run has it, on the right.
    """
    from matplotlib.figure import Figure

    meta, rows, jpeg = run["meta"], run["results"], run.get("jpeg") or []
    cases: list[dict[str, Any]] = []  # in the order the run measured them
    for row in rows:
        if row["case"] not in cases:
            cases.append(row["case"])
    fig = Figure(figsize=(13, 5) if jpeg else (9, 5), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[3, 1]) if jpeg else [fig.subplots()]
    left = axes[0]
    width = 0.8 / len(ARMS)
    for k, arm in enumerate(ARMS):
        points = [
            (i, row["speedup"])
            for i, case in enumerate(cases)
            for row in rows
            if row["case"] == case and row["arm"] == arm
        ]
        left.bar([i + k * width for i, _ in points], [v for _, v in points], width, label=arm)
    left.set_xticks(
        [i + width for i in range(len(cases))],
        [
            f"{c['kind']}\n{c['data_ms']:g}/{c['step_ms']:g} ms\n{c['batches']} batches"
            for c in cases
        ],
    )
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_ylabel("speedup over plain DataLoader")
    left.set_title("Synthetic loop (data/step ms per batch)")
    left.legend(loc="upper right")  # the no-work cases on the right stay near 1x
    if jpeg:
        right = axes[1]
        right.bar(range(len(jpeg)), [r["speedup"] for r in jpeg], color="C2")
        right.set_xticks(
            range(len(jpeg)),
            [f"{r['torch_threads']} thr.\n{r['num_workers']} wkr." for r in jpeg],
        )
        right.set_xlabel("torch threads, DataLoader workers")
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_title("JPEG + conv net (CPU),\nprefetchx over plain")
    fig.suptitle(
        f"prefetchx {meta['prefetchx']} at {meta['commit']}, torch {meta['torch']}, "
        f"Python {meta['python']}, {meta['cpus']} CPUs"
    )
    return fig


def save(run: Mapping[str, Any], path: str) -> None:
    """Draw ``run`` (see `figure`) into the image file ``path``; its suffix picks the format."""
    figure(run).savefig(path, dpi=110)
