"""The suite's own set-up (``conftest.py``): how many processes plain `pytest` runs it in."""

from __future__ import annotations

import os

import pytest

import conftest

pytest_plugins = ["pytester"]


def _processes(pytester: pytest.Pytester, *args: str) -> object:
    """``-n`` as pytest-xdist reads it, after our hook has seen the command line ``args``."""
    config = pytester.parseconfig(*args)
    conftest.pytest_cmdline_main(config)
    return config.option.numprocesses if config.pluginmanager.hasplugin("xdist") else "no xdist"


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A machine of 2 cores, outside any xdist worker."""
    pytest.importorskip("xdist")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    return monkeypatch


def test_plain_pytest_runs_in_two_processes(
    pytester: pytest.Pytester, two_cores: pytest.MonkeyPatch
) -> None:
    assert _processes(pytester) == conftest.WORKERS == 2


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("-n", "0"), 0),
        (("-n", "3"), 3),
        (("-p", "no:xdist"), "no xdist"),
        (("--pdb",), None),
        (("--collect-only",), None),
        (("--dist", "loadfile"), None),
    ],
)
def test_what_the_command_line_asks_for_wins(
    pytester: pytest.Pytester,
    two_cores: pytest.MonkeyPatch,
    args: tuple[str, ...],
    expected: object,
) -> None:
    assert _processes(pytester, *args) == expected


def test_one_core_or_a_worker_runs_in_one_process(
    pytester: pytest.Pytester, two_cores: pytest.MonkeyPatch
) -> None:
    two_cores.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _processes(pytester) is None
    two_cores.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    two_cores.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker never starts workers of its own
    assert _processes(pytester) is None
