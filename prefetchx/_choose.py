"""Whether the thread runs: it does, unless the loop is measurably faster without it.

A thread hides the time a batch takes to make behind the loop's step, and costs a hand-off per
batch and the GIL and cores it shares with the step. Which wins depends on the data, the step,
the machine and the moment. The costs are asymmetric: where the thread
loses, batches are cheap (a loop with no step, microseconds of data), so running with it first
costs little; where it wins, batches are dear, so running without it first would cost a
millisecond or more a batch. So the thread runs from a loader's second batch, and the loop alone
is tried (a *probe*) only where a probe is cheap next to the loop's time.

The one figure that settles it is the loop's wall time per batch, ``next()`` and the step together,
over windows of `WINDOW` batches. A probe runs the other mode for up to `PROBE` windows, each
between two windows of the current mode (the last before the probe, then one after each probe
window), and holds the probe windows' mean against the mean of the current windows around each:
a drift of the loop's pace (a warm-up, a phase of the loop, the machine's other work, worker
processes taking turns at the cores) moves both sides alike and cancels, where windows held
against the ones before the probe alone took a slower mode for a faster one (traced on a loop
with workers). It takes the other mode once the difference is below zero by more than `Z`
standard errors, and ends, lost, once the difference is not below zero, or after `PROBE`
windows. The standard error weighs each mode by its own spread (Welch's), the current mode's
from its last `HISTORY` windows: a thread that shares the GIL with the step makes its windows
stray far more than the loop alone makes its own, and a spread borrowed from one mode would make
the test too strict one way and too lax the other. So a probe switches after two windows at the
earliest (one window has no spread). Where windows stray by 10% (normal), a mode 5% slower than
the current one is taken in about 3 probes of 100, one 10% slower in 1, and one 30% faster in 98;
where the loop's pace drifts by 2% a window, the first two stay (a probe held against the windows
before it alone took them in 14 and 7), and the last falls to 94 (``tests/test_choose.py`` counts
them); a mode as fast is taken in about 1 of 10, which costs nothing, the two being alike. A
machine busy with other work makes the windows stray, and the current mode stays.

What a probe costs where it loses is bounded from the figures the current mode shows:

* threaded, the loop alone is slower by at most ``min(step, produce)`` a batch: the thread can
  hide no more than the shorter of the step and the making of a batch, and each of those only
  grows with a thread beside it (the GIL, the cores), so the threaded figures bound them;
* parked, the thread has no such bound. Where it was measured before (the windows the loop ran
  in it before it was parked, or a probe's), it costs what it cost then over the current mode,
  a batch; a thread that shares the GIL with a loop of no work costs several times the loop's
  period. Otherwise it is taken to cost at most the whole period a batch.

Probes are paced by a ledger of what they cost: each probe window is charged what it took beyond the
current mode's mean, and so are the batches around each switch it asked for, which no window
measures (the thread filling its queue, or handing over what it made); a probe starts only where
its first window and the batches around its two switches, in and out, each at the bound above,
keep the charges within `BUDGET` of the loop's time, counting the time the loop has run and the
rest of the current epoch at its pace. A probe goes on past its first window only while it is
faster than the current mode, so it costs about one window and two switches where it loses.
So a long epoch of cheap batches probes at once, and a short one of dear batches, where a probe
would cost a visible share of it, does not probe at all. Each probe the current mode wins halves the
share until the next switch, down to `BUDGET` over ``2 ** MAX_BACKOFF``: where the answer holds,
looking again costs ever less, and a loop that changed is still looked at again within a bounded
time.

`Decision` is the decision alone, fed one window at a time, with no clock and no thread, so that
it can be tested on numbers. The loader keeps one for its life: each epoch starts in the mode the
last one left.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

WINDOW = 4
"""Batches in a measured window, at first. A losing probe usually costs one window, and a
loader's first probe waits for `HISTORY` windows: short windows make both cheap. The test (see
the module) weighs the windows' own spread, so a longer window only decides a smaller difference
in fewer windows. Each probe lost in a row doubles the windows (`Decision.window_batches`), as it
halves the probes' share: where the answer holds, the loop is measured ever less often, which
costs it less (a window's end runs the decision's Python)."""

HISTORY = 4
"""The current mode's last windows, whose spread a probe's test weighs. A loader's first probe
waits for them, a loop with no work in the thread's mode all the while. With the probe's windows
held against the current ones around them, their number moves the rates the module states
little (the simulation of ``tests/test_choose.py``, 8000 probes a rate: a mode 30% faster taken
in 98.5 of 100 with 3, 4 or 6 windows; one 10% slower in 1.05, 0.8 and 0.75); 3 would start a
loader's first probe a window sooner, a change not yet timed."""

PROBE = 4
"""Windows of the other mode a probe measures, at most."""

Z = 2.0
"""Standard errors of the difference by which a probe's mean must beat the current mode's."""

QUIET_WINDOW = 256
"""Batches in a window while no probe can come, even after `HISTORY` more windows (the ledger
would not pay for it): the loop's time is only counted then, and a window's end, which runs the
decision's Python (about 15 us where the loop leaves the caches cold, measured on the 2-core VM),
comes rarely: 0.06 us a batch. The windows a probe is held against are measured anew after."""

MAX_BACKOFF = 4
"""Halvings of `BUDGET` at most while probes keep losing: the tax of looking again falls to
1/16 of it (0.125% of the loop's time), and a loop that changes is looked at again within 16
times what it takes to pay one window at `BUDGET`."""

BUDGET = 0.02
"""The share of the loop's time that probes may cost where they lose: well inside the 5% that a
paired ratio of two runs moves by on a shared 2-core machine, and that the targets allow."""


class Window(NamedTuple):
    """One measured window of the loop: `WINDOW` batches in one mode."""

    threaded: bool
    """Whether the thread made the window's batches."""
    batches: int
    """How many batches it had."""
    period: float
    """The loop's wall time per batch, seconds: ``next()`` and the step together."""
    step: float
    """The mean step, the time between handing a batch over and the next ``next()``."""
    produce: float
    """The mean time the thread took to make a batch; ``nan`` where it made none."""
    remaining: int | None = None
    """Batches left in the epoch after this window, where the epoch has a length."""


class Decision:
    """Whether the thread should make the next batches, from the windows measured so far."""

    def __init__(self) -> None:
        self.threaded = True
        """The mode the loop runs in outside probes."""
        self.note = ""
        """Why the loop runs without the thread, from the probe that chose it; "" while it runs
        with the thread."""
        self._history: deque[float] = deque(maxlen=HISTORY)
        self._probe: list[float] | None = None  # the other mode's windows, during a probe
        self._elapsed = 0.0  # loop seconds measured
        self._spent = 0.0  # what the probes cost: their windows' time beyond the current mode
        self._backoff = 0  # probes lost in a row since the last switch, up to MAX_BACKOFF
        self._quiet = False  # no probe can come soon: long windows, counted only
        self._last: Window | None = None  # the last window taken, for its per-batch figures
        self._other: float | None = None  # the other mode's period, from its last windows
        self._switched = False  # the last window asked for the other mode: a switch under way
        self._brackets: list[float] = []  # during a probe, the current mode's windows around it
        self._switch_batches = 0  # batches a switch leaves unmeasured, as last seen

    @property
    def window_batches(self) -> int:
        """Batches in the next window: `WINDOW`, doubled by each probe lost in a row, or
        `QUIET_WINDOW` while no probe can come soon."""
        return QUIET_WINDOW if self._quiet else self._measured_batches

    @property
    def _measured_batches(self) -> int:
        return WINDOW << self._backoff

    @property
    def wanted(self) -> bool:
        """Whether the thread should make the next batches: during a probe, the other mode and
        the current one by turns, each window of the other between two of the current."""
        probe = self._probe
        return self.threaded != (probe is not None and len(probe) < len(self._brackets))

    @property
    def probing(self) -> bool:
        """Whether a probe of the other mode is under way."""
        return self._probe is not None

    def window(self, window: Window) -> bool:
        """Take one measured window; return `wanted` for the next ones.

        A window measured in a mode other than the one wanted is not the decision's (the stage
        had not switched yet) and is left out.
        """
        if window.threaded != self.wanted:
            return self.wanted
        self._elapsed += window.period * window.batches
        probe, history = self._probe, self._history
        if probe is not None and window.threaded != self.threaded:
            # A probe's window: charged what it took beyond the current mode's pace.
            probe.append(window.period)
            self._spent += window.batches * max(0.0, window.period - statistics.fmean(history))
        else:
            self._last = window
            if probe is not None:
                self._brackets.append(window.period)
                history.append(window.period)
                self._judge()
            elif window.batches == self._measured_batches:
                history.append(window.period)
                if len(history) == HISTORY and self._affordable(window, 0):
                    self._probe, self._brackets = [], [window.period]
        quiet = (
            self._probe is None
            and window.threaded == self.threaded
            and not self._affordable(window, HISTORY)
        )
        if self._quiet and not quiet:
            self._history.clear()  # held against windows of its own length, just before it
        self._quiet = quiet
        self._switched = self.wanted != window.threaded
        return self.wanted

    def epoch_ended(self, unmeasured: float = 0.0) -> None:
        """An epoch ended: a probe under way is dropped (its windows would span two epochs), and
        the loop's ``unmeasured`` seconds since its last window count as time it has run.

        An epoch shorter than `QUIET_WINDOW` ends every long window before it is complete: its
        time is counted here, or a loop of short epochs would never pay for a probe.
        """
        self._probe = None
        self._switched = False
        self._elapsed += unmeasured
        last = self._last
        if self._quiet and last is not None:
            self._quiet = not self._affordable(last._replace(remaining=None), HISTORY)
            if not self._quiet:
                self._history.clear()  # held against windows of its own length, just before it

    def unmeasured(self, seconds: float, batches: int) -> None:
        """The loop ran ``batches`` batches in ``seconds`` that no window measured, after a
        switch: counted as the loop's time; and where the switch was one this decision asked
        for (into a probe's window, or back out of it), what they took beyond the current mode's
        pace is charged to the probes. The thread's start at an epoch's second batch is not a
        probe's: every epoch pays it, probes or none. The batches are how many a switch leaves
        unmeasured, which the next probe's price counts."""
        self._elapsed += seconds
        self._switch_batches = batches
        if self._switched and self._history:
            self._spent += max(0.0, seconds - batches * statistics.fmean(self._history))

    def _affordable(self, window: Window, windows_ahead: int) -> bool:
        """Whether a probe after ``windows_ahead`` more windows keeps every probe's cost within
        `BUDGET` of the loop's time (at the current pace): its first window of the other mode,
        and the batches around the two switches, in and out, each priced at the bound."""
        if window.threaded:
            known = [v for v in (window.step, window.produce) if not math.isnan(v)]
            if not known:
                return False
            per_batch = min(known)
        else:
            other = self._other
            per_batch = (
                window.period if other is None else max(window.period, other - window.period)
            )
        batches = self._measured_batches
        horizon = self._elapsed + windows_ahead * batches * window.period
        if window.remaining is not None:
            horizon += window.remaining * window.period
        share = BUDGET / (1 << self._backoff)
        price = (batches + 2 * self._switch_batches) * per_batch
        return self._spent + price <= share * horizon

    def _judge(self) -> None:
        """A probe's window of the other mode now has the current mode's on both sides: end
        the probe, lost or won, or let it go on."""
        probe, brackets = self._probe, self._brackets
        assert probe is not None  # probing
        assert len(brackets) == len(probe) + 1  # each probe window between two current ones
        n = len(probe)
        after = statistics.fmean(probe)
        # Each probe window against the mean of the two around it: a drift of the loop's pace
        # shifts both alike, and cancels.
        before = statistics.fmean((a + b) / 2 for a, b in itertools.pairwise(brackets))
        beyond_doubt = n >= 2 and after < before - Z * _bracketed_error(probe, self._history)
        if after >= before or (not beyond_doubt and n == PROBE):
            # Lost: no faster, or not faster beyond doubt. The current mode stays.
            self._probe = None
            self._other = after
            self._backoff = min(self._backoff + 1, MAX_BACKOFF)
            return
        if not beyond_doubt:
            return  # faster so far, not yet beyond doubt: one more window
        self.threaded = not self.threaded
        self._probe = None
        self._other = before
        self._backoff = 0
        self._last = None  # a window of the mode left: its figures do not price probes now
        self._history.clear()
        self._history.extend(probe)
        self.note = (
            ""
            if self.threaded
            else f"the loop ran {before / after:.2f}x as fast without the thread "
            f"({_duration(after)} against {_duration(before)} a batch)"
        )


def _bracketed_error(probe: Sequence[float], current: Sequence[float]) -> float:
    """The standard error of a bracketed probe's difference (`Decision._judge`): the mean of
    ``n`` probe windows, less that of the ``n + 1`` current windows around them, the two at its
    ends counted half. Each mode's spread is its own (Welch's): the probe's from its windows,
    the current mode's from its last ones, ``current``. The current windows' weighted mean has
    variance ``s**2 * (n - 1/2) / n**2``. Both have two values at least."""
    n = len(probe)
    return math.sqrt(
        statistics.variance(probe) / n + statistics.variance(current) * (n - 0.5) / n**2
    )


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"
