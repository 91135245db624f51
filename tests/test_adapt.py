"""The choice between the thread and the caller, on numbers: `Chooser` fed window by window."""

from __future__ import annotations

import itertools
import random
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
    SMOOTHING,
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
    # The loop changed: one window moves the smoothed time per batch by twice the threshold.
    loop.periods = {False: 1 * MS * (1 + 2 * CHANGED / SMOOTHING), True: 0.5 * MS}
    loop.run(4)
    assert loop.modes[-4:] == [False, False, True, True]  # saw the change, measured, probed
    assert loop.threaded


def test_the_next_epoch_starts_with_the_winner() -> None:
    memory = Memory()
    Loop(Chooser(memory), inline=2 * MS, threaded=1 * MS).run(10)
    assert Chooser(memory).start() == (True, SETTLE)


def test_noisy_windows_neither_look_like_a_change_nor_win_a_probe_by_luck() -> None:
    # Each window's time per batch is up to 25% off its mean, either way, as 16 random steps
    # of 20 us or 2 ms are; the thread is 15% faster on average. Over 40 loops of 600 windows
    # (seeded), the thread runs 90% of the windows or more, and the loop loses under 1.5%.
    shares = []
    for seed in range(40):
        rng = random.Random(seed)
        chooser = Chooser(Memory())
        threaded, _ = chooser.start()
        modes = []
        for _ in range(600):
            modes.append(threaded)
            period = (0.85 if threaded else 1.0) * MS * rng.uniform(0.75, 1.25)
            threaded, _ = chooser.window(period, _means())
        shares.append(sum(modes) / len(modes))
    assert sum(shares) / len(shares) > 0.9
    assert sorted(shares)[len(shares) // 2] > 0.95


def test_probes_go_on_across_epochs_at_the_pace_reached() -> None:
    memory = Memory()
    Loop(Chooser(memory), inline=1 * MS, threaded=2 * MS).run(300)
    backoff, since = memory.backoff, memory.since
    assert backoff > 16
    loop = Loop(Chooser(memory), inline=1 * MS, threaded=2 * MS)
    assert loop.length == WINDOW  # inline from the start, no short first window
    loop.run(backoff - since - 1)
    assert not any(loop.modes)  # the next probe comes when the last epoch's count says
    loop.run(2)
    assert loop.modes[-1]


def test_an_epoch_that_ends_in_a_probe_leaves_it_to_the_next() -> None:
    memory = Memory()
    first = Loop(Chooser(memory), inline=2 * MS, threaded=1 * MS)
    first.run(1)  # the first window, inline; the thread's probe starts, and the epoch ends
    assert first.threaded
    assert memory.probing
    second = Loop(Chooser(memory), inline=2 * MS, threaded=1 * MS)
    assert (second.threaded, second.length) == (True, SETTLE)  # the probe, from its start
    second.run(2)
    assert memory.threaded is True
    assert not memory.probing
