"""The choice between the thread and the caller, on numbers: `Chooser` fed window by window."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from prefetchx._adapt import (
    CHANGED,
    CLEAR_GROWTH,
    FIRST,
    HIDE_AT_LEAST_S,
    MARGIN,
    MAX_BACKOFF,
    SETTLE,
    WINDOW,
    Chooser,
    Memory,
)

MS = 1e-3


def _means(step: float = 1 * MS, wait: float = 1 * MS) -> Callable[[], tuple[float, float]]:
    return lambda: (step, wait)


class Loop:
    """A loop whose time per batch is ``inline`` without the thread and ``threaded`` with it,
    run through a chooser; it records the mode of every window."""

    def __init__(self, chooser: Chooser, inline: float, threaded: float) -> None:
        self.chooser = chooser
        self.periods = {False: inline, True: threaded}
        self.modes: list[bool] = []
        self.threaded, self.length = chooser.start()

    def run(self, windows: int, step: float = 1 * MS, wait: float = 1 * MS) -> None:
        for _ in range(windows):
            self.modes.append(self.threaded)
            period = self.periods[self.threaded]
            self.threaded, self.length = self.chooser.window(period, _means(step, wait))


def test_the_first_window_is_inline_and_short() -> None:
    assert Chooser(Memory()).start() == (False, FIRST)


def test_a_faster_thread_takes_over_after_its_probe() -> None:
    loop = Loop(Chooser(Memory()), inline=2 * MS, threaded=1 * MS)
    loop.run(3)
    # inline, then the probe: a settling window and a measured one, and the thread stays.
    assert loop.modes == [False, True, True]
    assert loop.threaded
    assert loop.chooser.memory.threaded is True
    assert loop.chooser.memory.backoff == CLEAR_GROWTH  # it won clearly


def test_a_slower_thread_is_sent_back_and_tried_less_and_less_often() -> None:
    loop = Loop(Chooser(Memory()), inline=1 * MS, threaded=2 * MS)
    loop.run(400)
    probes = [i for i in range(1, len(loop.modes)) if loop.modes[i] and not loop.modes[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps)  # ever rarer
    assert gaps[-1] > 64
    assert sum(loop.modes) <= 2 * len(probes)  # each probe: one settling, one measured window
    assert loop.chooser.memory.threaded is False
    assert loop.chooser.memory.backoff <= MAX_BACKOFF


def test_a_close_call_keeps_the_incumbent_and_probes_again_sooner() -> None:
    memory = Memory()
    loop = Loop(Chooser(memory), inline=1 * MS, threaded=1 * MS * (1 - MARGIN / 2))
    loop.run(3)
    assert not loop.threaded  # within the margin: the incumbent stays
    assert memory.backoff == 2  # not clear: doubled, not quadrupled


def test_a_settling_window_is_not_measured() -> None:
    chooser = Chooser(Memory())
    chooser.start()
    assert chooser.window(2 * MS, _means()) == (True, SETTLE)
    # The settling window is wildly slow (the queue filling): ignored.
    assert chooser.window(100 * MS, _means()) == (True, WINDOW)
    assert chooser.window(1 * MS, _means()) == (True, WINDOW)


@pytest.mark.parametrize(
    ("step", "wait"), [(0.0, 1 * MS), (1 * MS, 0.0), (HIDE_AT_LEAST_S / 2, 1 * MS)]
)
def test_a_thread_with_nothing_to_hide_is_never_tried(step: float, wait: float) -> None:
    loop = Loop(Chooser(Memory()), inline=step + wait, threaded=0.0)
    loop.run(50, step=step, wait=wait)
    assert not any(loop.modes)


def test_a_change_in_the_loop_brings_a_probe_at_once() -> None:
    loop = Loop(Chooser(Memory()), inline=1 * MS, threaded=2 * MS)
    loop.run(100)
    assert loop.chooser.memory.backoff > 16
    loop.periods = {False: 1 * MS * (1 + 2 * CHANGED), True: 0.5 * MS}  # the loop changed
    loop.run(3)
    assert loop.modes[-3:] == [False, True, True]  # measured the change, then probed
    assert loop.threaded


def test_the_next_epoch_starts_with_the_winner() -> None:
    memory = Memory()
    Loop(Chooser(memory), inline=2 * MS, threaded=1 * MS).run(10)
    assert Chooser(memory).start() == (True, SETTLE)
