"""The decision between the thread and the loop alone, on numbers: no clock, no thread."""

from __future__ import annotations

import itertools
import math
import random

from prefetchx._choose import (
    BUDGET,
    HISTORY,
    MAX_BACKOFF,
    PROBE,
    QUIET_WINDOW,
    WINDOW,
    Decision,
    Window,
)

US = 1e-6


def threaded(
    period: float, step: float, produce: float, remaining: int | None = None, batches: int = WINDOW
) -> Window:
    return Window(True, batches, period, step, produce, remaining)


def alone(period: float, remaining: int | None = None, batches: int = WINDOW) -> Window:
    return Window(False, batches, period, period * 0.5, math.nan, remaining)


def run(decision: Decision, make: dict[bool, Window], windows: int) -> list[bool]:
    """Feed ``windows`` windows, each in the mode the decision wants, from ``make``; return the
    modes the windows ran in."""
    modes = []
    for _ in range(windows):
        mode = decision.wanted
        modes.append(mode)
        decision.window(make[mode]._replace(batches=decision.window_batches))
    return modes


def test_a_new_decision_runs_the_thread() -> None:
    decision = Decision()
    assert decision.threaded
    assert decision.wanted
    assert not decision.probing
    assert decision.note == ""


def test_no_probe_before_the_thread_has_a_history() -> None:
    decision = Decision()
    for _ in range(HISTORY - 1):
        assert decision.window(threaded(100 * US, 2 * US, 60 * US, remaining=10**6))
    assert not decision.probing


def test_a_loop_faster_alone_parks_the_thread_at_its_first_probe() -> None:
    # No work in the step (2 us), 60 us to make a batch: the thread costs a hand-off a batch
    # and can hide 2 us. A long epoch pays for a probe at once.
    decision = Decision()
    make = {True: threaded(100 * US, 2 * US, 60 * US, remaining=4000), False: alone(40 * US)}
    modes = run(decision, make, HISTORY + 6)
    assert modes[:HISTORY] == [True] * HISTORY
    # The probe: the loop alone and the thread by turns, each window alone between two
    # threaded ones. Won by a wide margin in two windows alone, the fewest it can.
    assert modes[HISTORY : HISTORY + 4] == [False, True, False, True]
    assert not decision.threaded
    assert modes[HISTORY + 4 :] == [False, False]
    assert decision.note == (
        "the loop ran 2.50x as fast without the thread (40 us against 100 us a batch)"
    )


def test_where_the_thread_hides_a_dear_step_a_short_epoch_never_probes() -> None:
    # 5 ms of data and 5 ms of step, 120 batches: a probe could cost 5 ms a batch for up to
    # PROBE windows, more than BUDGET of the epoch.
    decision = Decision()
    left = 120
    while left > 0:
        left -= WINDOW
        assert decision.window(threaded(5.2e-3, 5e-3, 5e-3, remaining=max(0, left)))
        assert not decision.probing


def test_a_probe_that_loses_ends_after_one_window_and_the_thread_stays() -> None:
    decision = Decision()
    make = {True: threaded(100 * US, 50 * US, 50 * US, remaining=10**6), False: alone(180 * US)}
    modes = run(decision, make, HISTORY + 2)
    # One window of the loop alone was enough: the thread's after it ends the probe.
    assert modes[HISTORY:] == [False, True]
    assert not decision.probing
    assert decision.threaded


def test_a_difference_within_the_windows_stray_does_not_switch() -> None:
    # The thread's windows stray by +-10%; the loop alone reads 3% faster in every window of
    # its probe: not beyond doubt, so the probe ends lost after PROBE windows.
    decision = Decision()
    for i in range(HISTORY):
        decision.window(threaded((100 + (10 if i % 2 else -10)) * US, 50 * US, 50 * US, 10**6))
    assert decision.probing
    for i in range(PROBE):
        decision.window(alone(97 * US))
        assert decision.wanted  # the thread's window after each one alone
        decision.window(threaded((100 + (10 if i % 2 else -10)) * US, 50 * US, 50 * US, 10**6))
    assert not decision.probing
    assert decision.threaded


def test_a_clear_but_smaller_difference_switches_after_more_windows() -> None:
    # Windows that stray by +-5%, the loop alone 10% faster: one window is not enough, two are.
    decision = Decision()

    def thread_window(i: int) -> Window:
        return threaded((100 + (5 if i % 2 else -5)) * US, 50 * US, 50 * US, 10**6)

    for i in range(HISTORY):
        decision.window(thread_window(i))
    assert decision.probing
    decision.window(alone(90 * US))
    decision.window(thread_window(0))
    assert decision.probing
    decision.window(alone(90 * US))
    decision.window(thread_window(1))
    assert not decision.threaded


def _switch_rate(faster: float, drift: float = 0.0, probes: int = 2000) -> float:
    """The share of probes that switch where the other mode is ``faster`` (0.3: 30% less time
    a batch; below 0: slower) and every window strays by 10% (normal); with ``drift``, the
    loop's pace changes by that share of its first each window, both modes alike."""
    rng = random.Random(0)
    switches = 0
    for _ in range(probes):
        decision = Decision()
        for i in itertools.count():
            pace = 100 * (1 + drift * i)
            if decision.wanted:
                decision.window(threaded(rng.gauss(pace, 10) * US, 50 * US, 50 * US, 10**6))
            else:
                decision.window(alone(rng.gauss(pace * (1 - faster), 10) * US))
            if i >= HISTORY - 1 and not decision.probing:
                break
        switches += not decision.threaded
    return switches / probes


def test_a_slower_mode_is_rarely_taken_and_a_much_faster_one_almost_always() -> None:
    # The rates the module docstring states.
    assert _switch_rate(-0.10) < 0.02
    assert _switch_rate(-0.05) < 0.05
    assert _switch_rate(0.0) < 0.15  # alike: a swap costs nothing
    assert _switch_rate(0.30) > 0.97


def test_a_drift_of_the_loops_pace_does_not_make_a_slower_mode_look_faster() -> None:
    # A loop speeding up by 2% a window (a warm-up, the machine's other work ending): each
    # window of a probe is held against the current mode's windows on both sides of it, so the
    # drift cancels and the rates stay those of a steady loop. Held against the windows before
    # it alone, a mode 10% slower was taken in 7 probes of 100, and 5% slower in 14.
    assert _switch_rate(-0.10, drift=-0.02) < 0.02
    assert _switch_rate(-0.05, drift=-0.02) < 0.05
    assert _switch_rate(0.30, drift=-0.02) > 0.9


def test_a_warm_up_traced_on_a_loop_with_workers_does_not_park_the_thread() -> None:
    # The thread's windows fall by 5 us each (a warm-up); the loop alone is 5% slower at every
    # moment, but its windows come after the thread's: it reads faster than they did.
    decision = Decision()
    pace = iter(range(130, 0, -5))
    for _ in range(HISTORY):
        decision.window(threaded(next(pace) * US, 50 * US, 50 * US, 10**6))
    assert decision.probing
    while decision.probing:
        now = next(pace)
        if decision.wanted:
            decision.window(threaded(now * US, 50 * US, 50 * US, 10**6))
        else:
            decision.window(alone(now * 1.05 * US))
    assert decision.threaded


def test_windows_of_the_mode_not_wanted_are_left_out() -> None:
    # The stage had not switched yet: what it measured is not the probe's.
    decision = Decision()
    make = threaded(100 * US, 2 * US, 60 * US, remaining=4000)
    for _ in range(HISTORY):
        decision.window(make)
    assert decision.probing
    decision.window(make)  # still threaded
    assert decision.probing
    assert decision.threaded
    decision.window(alone(40 * US))
    decision.window(alone(40 * US))  # still alone: left out
    assert decision.probing
    assert decision.wanted
    decision.window(make)
    decision.window(alone(40 * US))
    decision.window(make)
    assert not decision.threaded


def test_an_epoch_that_ends_drops_the_probe_under_way() -> None:
    decision = Decision()
    for _ in range(HISTORY):
        decision.window(threaded(100 * US, 50 * US, 50 * US, 10**6))
    assert decision.probing
    decision.epoch_ended()
    assert not decision.probing
    assert decision.wanted


def test_a_parked_loop_tries_the_thread_again_and_takes_it_where_it_now_wins() -> None:
    # Parked where the loop alone ran faster; then the loop changes (a dear step comes), and a
    # later probe finds the thread faster.
    decision = Decision()
    run(decision, {True: threaded(100 * US, 2 * US, 60 * US, 4000), False: alone(40 * US)}, 10)
    assert not decision.threaded
    make = {True: threaded(1.1e-3, 1e-3, 1e-3, None), False: alone(2e-3, None)}
    modes = run(decision, make, 2000)
    assert True in modes
    assert decision.threaded
    assert decision.note == ""  # with the thread again: nothing to explain


def test_probes_cost_at_most_the_budget_where_they_lose() -> None:
    # A long run where the thread wins by 2x: the windows the loop alone ran (the probes) cost
    # at most BUDGET of the loop's time over what the thread would have taken, and the windows
    # grow as probes keep losing.
    decision = Decision()
    make = {True: threaded(1e-3, 1e-3, 1e-3, None), False: alone(2e-3, None)}
    lost = total = 0.0
    sizes = set()
    for _ in range(20000):
        mode, batches = decision.wanted, decision.window_batches
        sizes.add(batches)
        decision.window(make[mode]._replace(batches=batches))
        total += batches * (1e-3 if mode else 2e-3)
        lost += 0.0 if mode else batches * (2e-3 - 1e-3)
    assert lost > 0  # it does look again
    assert lost <= BUDGET * total
    assert decision.threaded
    # Measured windows double with each lost probe; between probes, long windows only count.
    assert sizes == {WINDOW << k for k in range(MAX_BACKOFF + 1)} | {QUIET_WINDOW}


def test_short_epochs_count_their_time_at_their_end_until_a_probe_can_pay() -> None:
    # Epochs of 40 batches of 10 ms, where a probe could cost 5 ms a batch: the first window
    # finds no probe affordable soon, and the loop is only counted, in windows of QUIET_WINDOW
    # batches that such an epoch never completes. Each epoch's time counts at its end; once
    # the loop has run long enough to pay for a probe, windows are measured again.
    first = threaded(10e-3, 5e-3, 5e-3, remaining=35)
    decision = Decision()
    decision.window(first)
    assert decision.window_batches == QUIET_WINDOW
    epochs = 0
    while decision.window_batches == QUIET_WINDOW:
        decision.epoch_ended(unmeasured=40 * 10e-3)
        epochs += 1
        assert epochs <= 3
    assert decision.window_batches == WINDOW
    # Uncounted, the same loop would be counted only, forever: no probe, whatever it costs.
    uncounted = Decision()
    uncounted.window(first)
    for _ in range(1000):
        uncounted.epoch_ended()
    assert uncounted.window_batches == QUIET_WINDOW


def _probe(history: list[float], probe: list[float], threaded_first: bool) -> Decision:
    """A decision whose current mode measured ``history`` (us a batch, its last windows), then
    probed the other mode for ``probe``, each window between two of the current mode's, which
    go on as ``history`` did (its values again, in turn)."""

    def measured(threaded_mode: bool, period: float) -> Window:
        if threaded_mode:
            return threaded(period * US, 180 * US, 200 * US, 10**6)
        return alone(period * US, 10**6)

    decision = Decision()
    if not threaded_first:  # parked, its windows so far at the history's first period
        make = {True: measured(True, 3 * history[0]), False: measured(False, history[0])}
        run(decision, make, HISTORY + 4)
        assert not decision.threaded
    for period in history:
        decision.window(measured(threaded_first, period))
        if decision.probing:
            break
    assert decision.probing
    current = itertools.cycle(history)  # the current mode's windows around the probe's
    for period in probe:
        decision.window(measured(not threaded_first, period))
        decision.window(measured(threaded_first, next(current)))
        if not decision.probing:
            break
    return decision


def test_a_steady_mode_is_taken_over_one_whose_windows_stray_where_it_is_clearly_faster() -> None:
    # Traced on the 2-core VM, pure-Python data and step of 200 us each: the thread's windows
    # stray by 80 us (it shares the GIL with the step), the loop alone's by 30, and it is 20%
    # faster. Held against the thread's spread alone, such probes lost, and the loop ran with
    # the thread, 55% slower, for hundreds of batches.
    decision = _probe([376.9, 509.0, 553.1, 498.3], [429.1, 379.4, 373.2, 369.7], True)
    assert not decision.threaded


def test_a_mode_whose_windows_stray_is_not_taken_on_a_steady_modes_spread() -> None:
    # The other way: parked, the loop alone steady at 100 us (+-1); the thread's windows read
    # 90 us on average but stray by 30: not beyond doubt.
    decision = _probe([100.0, 99.0, 101.0, 100.0], [60.0, 120.0, 60.0, 120.0], False)
    assert not decision.threaded


def test_a_parked_loop_counts_what_the_thread_cost_when_it_last_ran() -> None:
    # Parked at 25 us a batch, after the thread ran at 100 us in one loop and at 40 us in the
    # other: a probe of the thread costs about 75 us a batch in the first, more than the loop's
    # period, so the first waits longer for the loop's time to pay for it.
    def batches_to_probe(thread_us: float) -> int:
        decision = Decision()
        make = {True: threaded(thread_us * US, 2 * US, 20 * US), False: alone(25 * US)}
        run(decision, make, HISTORY + 4)
        assert not decision.threaded
        batches = 0
        while not decision.probing:
            batches += decision.window_batches
            decision.window(alone(25 * US)._replace(batches=decision.window_batches))
        return batches

    dear, cheap = batches_to_probe(100.0), batches_to_probe(40.0)
    assert dear > cheap


def test_the_batches_around_a_switch_are_charged_to_the_probes() -> None:
    # Two loops alike, whose probes of the loop alone lose; in one, the batches around each
    # probe's switches, which no window measures, cost 2 ms beyond the loop's pace: its probes
    # come less often, as the budget pays for fewer.
    def probes(charged: float) -> int:
        decision = Decision()
        count = 0
        for _ in range(2000):
            mode = decision.wanted
            decision.window(
                threaded(100 * US, 50 * US, 50 * US)._replace(batches=decision.window_batches)
                if mode
                else alone(180 * US)._replace(batches=decision.window_batches)
            )
            if decision.wanted != mode:  # a switch, to a probe or back from it
                decision.unmeasured(3 * 100 * US + charged, 3)
                count += not decision.wanted
        return count

    quick, slow = probes(0.0), probes(2e-3)
    assert slow < quick


def test_an_epochs_start_is_not_charged_to_the_probes() -> None:
    # Each epoch starts its thread after the first batch, and the meter leaves the batches
    # while its queue fills unmeasured. They cost the same with probes or without: a decision
    # that charged them would never afford a probe in a loop of short epochs.
    def probes_after(epochs: int, charged_start: float) -> bool:
        decision = Decision()
        for _ in range(epochs):
            decision.unmeasured(3 * 10e-3 + charged_start, 3)
            for left in range(32, -1, -WINDOW):
                if decision.probing:
                    return True
                decision.window(threaded(10e-3, 5e-3, 5e-3, remaining=left))
            decision.epoch_ended(unmeasured=0.0)
        return decision.probing

    assert probes_after(40, 0.0)
    assert probes_after(40, 20e-3)  # a start 20 ms slower than the pace: the same


def test_a_probes_price_counts_the_batches_its_switches_leave_unmeasured() -> None:
    # Two loops alike but for their queues: a switch leaves ``max_prefetch + 1`` batches
    # unmeasured (the thread's start at the epoch's second batch tells how many), 3 in one and
    # 33 in the other. A probe switches twice, so the deeper queue's first probe costs more,
    # and waits for more of the loop's time to pay for it.
    def batches_to_probe(switch_batches: int) -> int:
        decision = Decision()
        decision.unmeasured(switch_batches * 1e-3, switch_batches)  # the thread's start
        batches = 0
        while not decision.probing:
            size = decision.window_batches
            batches += size
            decision.window(threaded(1e-3, 0.5e-3, 0.5e-3)._replace(batches=size))
        return batches

    assert batches_to_probe(33) > batches_to_probe(3)
