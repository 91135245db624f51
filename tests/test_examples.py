"""The examples run as their docstrings say."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.helpers import torchrun

SUMMARY = re.compile(
    r"^rank (?P<rank>\d+)/2 device=(?P<device>\S+) epochs=1 steps=(?P<steps>\d+) "
    r"samples=(?P<samples>\d+) loss=(?P<loss>\S+) \| (?P<verdict>.+)$"
)


def _summaries(out: str) -> dict[int, dict[str, str]]:
    found = {}
    for line in out.splitlines():
        match = SUMMARY.match(line)
        if match:
            found[int(match["rank"])] = match.groupdict()
    return found


def _check_ddp_train(*extra: str) -> dict[int, dict[str, str]]:
    returncode, out, err = torchrun("examples/ddp_train.py", "--epochs", "1", *extra)
    assert returncode == 0, f"exit status {returncode}\n{out}\n{err[-4000:]}"
    summaries = _summaries(out)
    assert sorted(summaries) == [0, 1], out
    for summary in summaries.values():
        # 512 samples, 256 per rank, batches of 32 with drop_last.
        assert (summary["steps"], summary["samples"]) == ("8", "256"), out
        assert math.isfinite(float(summary["loss"])), out
        assert summary["verdict"].startswith(("compute-bound", "input-bound")), out
    return summaries


def test_ddp_train_on_the_cpu() -> None:
    summaries = _check_ddp_train("--cpu")
    assert {s["device"] for s in summaries.values()} == {"cpu"}


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ddp_train_puts_each_ranks_batches_on_its_own_gpu() -> None:
    summaries = _check_ddp_train()
    assert {rank: s["device"] for rank, s in summaries.items()} == {0: "cuda:0", 1: "cuda:1"}
