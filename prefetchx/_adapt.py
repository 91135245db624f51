"""Who makes the batches, the thread or the loop itself: whichever gives the loop its batches
faster, measured.

A thread hides the time a batch takes to make behind the loop's step, and costs a hand-off per
batch, the GIL and the cores it shares with the step. Which of the two wins depends on the data,
the step, the machine and what else runs, and it changes as the loop does (warm-up, evaluation
phases). So the stage measures the one figure that settles it, the loop's wall time per batch
(``next()`` and the step together), over windows of batches, in each mode, and keeps the faster.

`Chooser` is the decision alone, fed one window at a time, with no clock and no thread, so that
it can be tested on numbers; `ThreadStage` measures the windows and switches. What it learns
outlives the epoch in a `Memory` the loader keeps, so the next epoch starts in the mode that won.

The measurement is the one a depth controller needs too (the time per batch at each
``max_prefetch``, the faster under a memory budget, tf.data's AUTOTUNE being the anchor): a mode
here is one option, and a depth would be more of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import NamedTuple

WINDOW = 16
"""Batches in a measured window."""

FIRST = 4
"""Batches in a loader's first window, made inline after its first batch (whose wait includes
starting the epoch): they warm the loop up, and the loop alone's next window sets its figure.
In the grid's numpy loop of 20 us of data and 200 us steps without workers, they ran 15% slower
than the windows after them; in a traced run, a thread 5% slower took over against them and was
kept for the rest of the run. Where the loop settles slowly (`SLOW_SETTLE_S`), their step and
wait say whether the thread is the first incumbent."""

SETTLE = 4
"""Batches after a switch to the thread that are not measured: its queue fills."""

SETTLE_INLINE = 1
"""Batches after a switch to the loop that are not measured, once the loop has taken what the
thread had queued (those would flatter the mode just left; the stage does not end the window
before): the first the loop makes itself."""

PEEK = 4
"""Batches of a probe's measured window after which the probe ends, lost, if the probed mode is
already slower beyond doubt (see `Chooser._probe`): a losing probe then costs 8 batches of the
thread or 5 of the loop (after the thread's queued ones), not 20."""

MARGIN = 0.03
"""A probed mode takes over only when its time per batch beats the incumbent's by this much, or
by how far the incumbent's windows stray from their smoothed figure if that is more."""

CHANGED = 0.25
"""The incumbent's smoothed time per batch moving this far from its value at the last decision
says the loop has changed: the other mode is probed again at once."""

SMOOTHING = 0.25
"""Weight of each new window in the incumbent's smoothed time per batch (about the last 4
windows count)."""

STEP_TO_STRAY = math.sqrt(4 / 7)
"""A window's stray from the incumbent's figure, per unit of its difference from the window
before it, where windows vary at random. Two such windows differ by sqrt(2) times what one
strays from the loop's mean; a window strays from the figure (which averages about the last 4
windows, and so varies by ``SMOOTHING / (2 - SMOOTHING)``, a seventh, of a window's variance) by
sqrt(8/7) times: the ratio is sqrt(4/7). Told so, a loop that moves steadily (a warm-up, a ramp
of growing steps) adds one window's move to its stray; told from the figure, which trails such
a loop by about three windows' move, it added that lag, and a probe was held to a margin the
lag had swollen."""

CLEAR_GROWTH = 4
"""How much longer the next probe waits when this one was clear (one mode slower by more than
`CHANGED`): a clear answer is not noise."""

MAX_BACKOFF = 256
"""Windows between probes at most, while every probe confirms the incumbent: a probe of a mode
twice as slow then costs about 0.2% of the loop's time (8 batches, see `PEEK`)."""

PROBE_BUDGET = 0.01
"""The share of the loop's time a lost probe may cost, spread over the windows until the next:
after a probe that cost more than this share of ``backoff`` windows, the next waits as many
windows as it takes, up to `MAX_BACKOFF` (a mode 10% slower, probed for 20 batches, costs 2
batches' time: the next probe waits 13 windows, not 2)."""

STRAY = 4.0
"""A window further from the incumbent's smoothed figure than this many times how far its
windows stray (and than `CHANGED`) is held back: a pause of the machine, not the loop, unless
the next window is as far off on the same side."""

TICK_S = 1e-9
"""The least time per batch a window is taken to have: a clock that did not move over a window
(a coarse one, a loop of no work) says less than it can resolve, not zero."""

LEVELS = 8
"""Levels of the loop remembered with the pacing of their probes (see `Chooser._changed`)."""

KNOWN = 0.10
"""How much slower the other mode must have been in a level's last probe for that level's
pacing to go on when the loop comes back to it after other levels (see `Chooser._changed`):
more than a narrow loss, and less than a thread wins by on the grid's numpy ramp (about 16%).
There, with `CHANGED` for this and the loss taken against the incumbent's window after the
probe, the levels were probed again in every epoch: 3 probes of the loop alone an epoch, lost
by 17% to 35% against the line through the thread's windows either side but by 1% to 11%
against the window after, cost the ramp 0.970 of the recipe; 0.990 now, in the same rounds."""

LAG = 2 * WINDOW
"""Batches a change of the loop runs in the mode it left before the stage has seen the change
and probed, about: the window it began in, held back as a pause (see `STRAY`), and the one
that confirms it. Where the loop goes back and forth between two levels, it pays that at each
return (see `Chooser._worth_leaving`)."""

STEADY = 2.0
"""A loop that slowed through a lost probe, from the incumbent's window before to the one
after it far off its figure, is taken to move steadily (a ramp) where it slowed from the window
before that one at a pace within this factor of that: not a step just after the probe (a phase
beginning), which the windows either side of the probe alone cannot tell from a move."""

HIDE_AT_LEAST_S = 10e-6
"""Below this, the shorter of the mean step and the mean wait for data (what a thread could
hide at best, per batch) is less than any hand-off costs: the thread is not worth a probe."""

SLOW_SETTLE_S = 0.5
"""Seconds a switch of mode takes to show in the pace of a loop whose DataLoader workers are as
many as the CPUs it may use (`settle_for`). There the OS places the loop's threads and the
workers anew after a switch, and the pace moves for 0.3 s to over 1.5 s: on the 2-core VM with 2
workers, the thread read 0.92 to 0.97 of the loop alone's time per batch in the 2 windows after
a switch (what a probe of 20 batches sees) and 1.21 to 1.28 once settled in one loop, 0.74 and
1.11 in another, and 1.03 and 0.93 in a third, where it wins (``benchmarks/mode_trace.py``).
With 1 worker, or none, a mode's pace shows within a few batches, as `SETTLE` has it. Where a
loop settles slowly, the thread is the first incumbent where it may help (`_thread_may_help`):
there an epoch strays by about 10% in either mode, so a probe of one epoch keeps whichever mode
came first unless the other wins by more, and the thread loses by 0% to 10% where it loses
(numpy loops of 20 and 200 us; 15% in the second on another day, at 545d56d) and wins by 15% to
30% where it wins (Python loops), on the 2-core VM with 2 workers. The batches of this long
after a switch within an epoch, and after a loader's first 4, are not measured; its windows end
with the epoch (`SLOW_WINDOW_S`); a probe is measured whole, with no look after `PEEK` batches,
and an epoch's end does not put it off; and a change of the loop's pace brings no probe at once
(its pace drifts by more than `CHANGED` over seconds there, in either mode)."""

SLOW_WINDOW_S = 30.0
"""Seconds a measured window lasts at most where the loop settles slowly (`SLOW_SETTLE_S`):
there a window ends with the epoch, so that a probe and the incumbent are weighed over the same
batches of their epochs, and a ramp of steps within every epoch, or phases, weigh on both
alike. Windows of 0.5 s read a ramp within 1.1 s epochs as a fast half and a slow half: the
probe ran in the slow one, lost against the fast, and the loop alone was kept in every epoch
where the thread ran 1.25x (``benchmarks/kept_alone.py --shape ramp --workers 2``)."""


class Span(NamedTuple):
    """A measured window of the incumbent: where it was and its time per batch."""

    middle: float
    """Its middle, in batches of the epoch since its first (see `Chooser._at`)."""
    period: float


class Level(NamedTuple):
    """A level the loop was at, and where the probes there stood when it left."""

    threaded: bool | None
    """The incumbent there."""
    period: float
    """Its time per batch."""
    backoff: int
    since: int
    stray: float
    """How far its windows strayed, as a share of ``period``."""
    lost_by: float
    """How much slower the other mode was in the last probe decided there, as a share; 0 if
    none, below 0 where the other mode was faster but not worth the switch."""
    stayed: int = 0
    """Batches the loop ran there before it left."""


class Memory:
    """What a loader's epochs have learnt, so that each goes on where the last one stopped: the
    incumbent mode and its figures, when to look again, the levels the loop was at, and a
    probe an epoch ended in or put off."""

    __slots__ = (
        "backoff",
        "carried",
        "held",
        "last",
        "levels",
        "lost_by",
        "probing",
        "put_off",
        "reference",
        "seen",
        "settle_left",
        "settle_s",
        "since",
        "smooth",
        "spread",
        "stayed",
        "threaded",
        "visited",
    )

    def __init__(self) -> None:
        self.threaded: bool | None = None
        """The incumbent mode; ``None`` before the first window."""
        self.backoff = 1
        """Measured windows of the incumbent between two probes of the other mode."""
        self.since = 0
        """Measured windows of the incumbent since the last probe."""
        self.probing = False
        """Whether the other mode is being probed (an epoch may end in a probe)."""
        self.put_off = False
        """Whether a probe due as the last epoch ended was put off to the next."""
        self.carried = False
        """Whether the probe of the thread under way was carried over from the last epoch,
        where its window that ended the epoch beat the incumbent (see `_drained`)."""
        self.smooth = math.nan
        """The incumbent's time per batch, smoothed over its windows."""
        self.spread = 0.0
        """How far the incumbent's windows stray from ``smooth`` at random, smoothed alike:
        told from how far each differs from the one before it (see `STEP_TO_STRAY`)."""
        self.last = math.nan
        """The time per batch of the incumbent's last window counted into ``smooth``, or of
        the window ``smooth`` was last set from; NaN before the first."""
        self.reference = math.nan
        """``smooth`` when it was last decided or seen to change."""
        self.held = math.nan
        """The time per batch of the incumbent's last window, when it was held back as far off
        (see `STRAY`); NaN when it was not."""
        self.lost_by = 0.0
        """How much slower the other mode was in the last probe decided since the loop's last
        change (the probed mode's, where it lost; the incumbent left's, where the probed mode
        took over), as a share of the incumbent's time; 0 if none, below 0 where the probed
        mode was faster but kept out (see `Chooser._worth_leaving`)."""
        self.stayed = 0
        """Batches since the loop's last change, probes included."""
        self.visited = 0
        """Batches the loop ran at its present level the last time it was there; 0 if it
        was not there before (as far as `levels` remember)."""
        self.levels: list[Level] = []
        """The levels the loop was at before its last `LEVELS` changes, the latest first."""
        self.settle_s = 0.0
        """Seconds a switch of mode takes to show in the loop's pace, where that is longer than
        a few batches (`SLOW_SETTLE_S`, set by the loader from `settle_for`); 0 otherwise."""
        self.seen = math.nan
        """The time per batch of the last window measured, in either mode: the loop's pace
        before the incumbent has a figure (see `Chooser._span`)."""
        self.settle_left = 0
        """Batches of a slow settling still to run, where a probe's settling was cut short by
        an epoch's end and the probe goes on in the next epoch; 0 otherwise."""


class Chooser:
    """The decision, window by window, for one epoch of a loader whose `Memory` it carries on.

    `start` says how the epoch begins (after its first batch, always made inline); then each
    `window` is told the loop's time per batch over the window that just ended, and answers
    with the mode and the length of the next window. A probe switches to the other mode for a
    settling window and a measured one, then keeps whichever was faster (where the loop goes
    back and forth between two levels, the faster here only if that pays for the lag at the
    return, see `_worth_leaving`); it ends after the
    measured window's first `PEEK` batches if they are slower beyond doubt; a probe lost while
    the loop slowed is weighed again against the incumbent's windows either side of it, and may
    take over late (where the window after it is too far off to tell a move from a step, the
    change it confirms brings a probe at once); a probe due as an epoch ends, or cut short by
    it before it has measured `PEEK` batches, waits for the incumbent's first window of the next
    epoch, once, and one begun right after that is left to the next epoch if cut short again.
    The incumbent's time per batch is smoothed over its windows, so that a loop whose steps vary
    from batch to batch (a window of 16 random steps is noisy) neither looks like it changed nor
    loses a comparison to a lucky probe. Where a switch takes seconds to show in the loop's
    pace (``Memory.settle_s``), windows end with the epoch instead, and a switch within one is
    measured only once settled (see `SLOW_SETTLE_S`).
    """

    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self.threaded = False
        """The mode of the current window."""
        self.switches = 0
        """Switches of mode so far, probes and their returns included."""
        self._settling = False
        self._length = 0
        """The length of the window now running, as this returned it."""
        self._probed = 0
        """Batches of the probe's measured window so far."""
        self._probed_s = 0.0
        """Their time, in seconds."""
        self._deferrable = False
        """Whether the probe under way began in this epoch, and not right after being put off:
        an epoch's end that comes before it has measured enough puts it off (see `_put_off`).
        Put off once only, or epochs shorter than a probe would never finish one."""
        self._grown = 0
        """After a lost probe, until the incumbent's next measured window: the wait for the
        next probe that growth alone sets (see `_pace`); 0 otherwise."""
        self._cost = 0.0
        """What the last lost probe cost, in batches of the incumbent's time."""
        self._lost: tuple[float, float, tuple[Span, ...]] = (math.nan, math.nan, ())
        """After a lost probe, until the incumbent's next measured window: the probe's time per
        batch, where its measured batches were (their middle, see `_at`), and the incumbent's
        last windows before it (see `_lost_to_a_move`)."""
        self._at = 0
        """Batches of the epoch in windows so far (after its first batch), the window now
        running not yet counted: where each window was, for `_lost_to_a_move`."""
        self._spans: tuple[Span, ...] = ()
        """The incumbent's last two measured windows of this epoch since it took over (held back
        ones too), the latest last."""
        self._settled = 0
        """Batches of the last settling window asked for."""
        self._after_settle = False
        """Whether the window now running is the incumbent's first after a slow settling
        (`SLOW_SETTLE_S`) within the epoch: cut short by the epoch's end, it is the epoch's
        tail (see `window`). Not after the few batches of an epoch's start, in which the
        thread fills its queue: the window after those is the epoch, less them."""
        self._settled_slowly = False
        """Whether the settling window now running is a slow one (`SLOW_SETTLE_S`)."""
        self._returned = 0.0
        """Where the loop settles slowly, after a lost probe: what the incumbent's settling
        window on its return cost over its figure, in batches of its time (see `_pace`)."""
        self._filled = (0.0, 0)
        """The seconds and batches of the last settling window, until a window after it is
        counted: where it was the thread's, it built the lead that the thread's window ending
        the epoch drains (see `_drained`)."""
        self._slowed = False
        """After a probe lost while the loop slowed, its time per batch under the incumbent's
        first window after it, that window far off (a move and a step look alike there): until
        the incumbent's next window, a change that window confirms brings a probe at once, even
        at a level whose pacing goes on (see `_changed`)."""

    @property
    def steady(self) -> bool:
        """Whether the next window is the incumbent's, with no probe under way. With the loop
        making the batches at under twice `HIDE_AT_LEAST_S` a batch, its end is then decided on
        the window's time alone."""
        return not (self.memory.probing or self._settling)

    def start(self) -> tuple[bool, int]:
        """The first mode after the epoch's first batch, and its window's length."""
        memory = self.memory
        incumbent = memory.threaded
        if incumbent is None:
            return self._run(False, FIRST)
        self.threaded = (not incumbent) if memory.probing else incumbent
        if self.threaded or memory.probing:
            return self._settle()  # the thread starts with an empty queue
        return self._run(False, self._span())

    def window(
        self, period: float, means: Callable[[], tuple[float, float]], ending: bool = False
    ) -> tuple[bool, int]:
        """A window ended: the mode for the next one and its length.

        Args:
            period: The loop's wall time per batch over the window, in seconds.
            means: Gives the window's mean step (from getting a batch to asking for the next)
                and mean wait inside ``next()``; called only when they are needed.
            ending: The window was cut short by the epoch's end: a probe that has measured
                `PEEK` batches or more is decided on them, or an epoch shorter than a probe
                would start it again and again and never decide (but a probe of the thread
                that would win on them is measured again in the next epoch, once: see
                `_drained`); one that has measured fewer is put off, once (see `_put_off`).
        """
        memory = self.memory
        memory.stayed += self._length
        self._at += self._length
        period = memory.seen = max(period, TICK_S)  # compared as a ratio below
        deferrable = self._deferrable and not memory.settle_s  # there it goes on (`_settle`)
        after_settle, self._after_settle = self._after_settle, False
        if ending and memory.probing and deferrable and self._probed_by() < PEEK:
            return self._put_off()
        if self._settling:
            self._settling = False
            self._filled = (period * self._length, self._length)
            if memory.settle_s:
                if ending and memory.probing and self._length < self._settled:
                    memory.settle_left = self._settled - self._length  # goes on next epoch
                elif self._grown and not memory.probing:  # the return from a lost probe
                    self._returned = max(0.0, period / memory.smooth - 1) * self._length
            if memory.probing:  # the probe's measured window: its first batches, a look
                self._probed, self._probed_s = 0, 0.0
                return self._run(self.threaded, self._span() if memory.settle_s else PEEK)
            self._after_settle = self._settled_slowly
            return self._run(self.threaded, self._span())
        if memory.probing:
            return self._probe(period, ending)
        if ending and self._drained():
            seconds, batches = self._filled
            if not batches:  # the thread's windows before it were counted: it drains them
                return self._run(self.threaded, self._span())
            # The thread's only window after its settling: weighed with that, as one.
            period = (seconds + period * self._length) / (batches + self._length)
        self._filled = (0.0, 0)
        if memory.threaded is None:  # the loader's first batches, which run cold (`FIRST`)
            if not memory.settle_s:
                # A figure from them would hand the first probe a lead it did not earn: the
                # loop alone's next window sets it.
                memory.threaded = False
                return self._run(False, self._span())
            # Where the loop settles slowly they size the windows, and the first incumbent
            # settles before its figure is taken: the thread where it may help, the loop alone
            # to be probed against it (see `SLOW_SETTLE_S`).
            memory.threaded = _thread_may_help(period, means)
            if memory.threaded:
                return self._switch()
            return self._settle(switched=True)
        mode = memory.threaded = self.threaded
        here = Span(self._at - self._length / 2, period)
        smooth = memory.smooth
        unsure = False  # the figure is from one window, its stray not yet told (below)
        slowed, self._slowed = self._slowed, False
        if self._grown:  # the incumbent's first window since a lost probe: what it paid too
            self._pace(max(0.0, period / smooth - 1) * self._length + self._returned)
            self._grown, self._returned = 0, 0.0
            if self._lost_to_a_move(here):
                return self._take_over()
        self._spans = (*self._spans[-1:], here)
        if math.isnan(smooth):
            if after_settle and ending and memory.settle_s:
                # Where the loop settles slowly, a probe is weighed over a whole epoch (see
                # `SLOW_WINDOW_S`), and this window is an epoch's tail: a loader's first epoch
                # after its settling, or one after the other mode took over. No figure from it:
                # the next epoch's first window sets it. A figure from the first epoch's tail
                # read 0.55 ms a batch where the loop's epochs ran at 1.2 ms; the thread, 0.91
                # over its whole epoch, lost to it and was not probed again for 67 epochs.
                return self._run(mode, self._span())
            memory.smooth = memory.reference = memory.last = period
            # A figure from one window, where none has told how far the loop's windows stray (a
            # loader's first), tells the loop's pace alone: no probe until the next window has told
            # that too. Weighed against one window of uneven steps, with no noise allowed for, a
            # probe takes that window's luck for a difference. In the grid's numpy loop of random
            # 20 us or 2 ms steps without workers, a new loader's first figure read 0.90 ms a batch
            # where its windows ran at 1.1 to 1.9; the thread lost its first probe clearly on 4
            # batches, was probed ever more rarely, and the loop alone was kept: 0.85 of the recipe,
            # 0.96 with this wait (``benchmarks/results/chooser-variants/``
            # ``stray-before-first-probe-0d9292d.txt``). Not where the loop settles slowly: a window
            # is an epoch there.
            unsure = not memory.spread and not memory.settle_s
        elif self._far_off(period):
            held, memory.held = memory.held, math.nan
            if math.isnan(held) or (held > smooth) != (period > smooth):
                memory.held = period  # one window far off: a pause, unless the next says so too
                return self._run(mode, self._span())
            # Two windows far off on the same side: the loop changed. Probe now, against the
            # figure of the window since the change.
            self._changed(period, smooth, wait=0, slowed=slowed)
        else:
            memory.held = math.nan
            last, memory.last = memory.last, period
            # From the figure where no window came before it (a figure set from outside).
            stray = abs(period - smooth) if math.isnan(last) else STEP_TO_STRAY * abs(period - last)
            # The first stray is taken whole: from nothing, a loop's first windows would pass
            # for calm, and hold back as pauses windows that only vary as its windows do.
            memory.spread += (stray - memory.spread) * (SMOOTHING if memory.spread else 1.0)
            memory.smooth = smooth = smooth + (period - smooth) * SMOOTHING
            if abs(smooth / memory.reference - 1) > CHANGED:
                # The loop changed by steps: probe again after one more window, against a
                # figure from the two windows since the change, not one that still lags behind.
                self._changed(period, memory.reference, wait=1)
        memory.since += 1
        due = (
            not unsure
            and memory.since >= memory.backoff
            and (mode or _thread_may_help(period, means))
        )
        # A probe due as the epoch ends is put off, once: it would run at the next epoch's
        # start, against a figure from this one's end, and an epoch's first batches need not
        # be the loop its last were (a ramp begins again). It begins after the incumbent's
        # first window there, even if that one ends its epoch too (epochs of a window or less).
        defer = due and ending and not memory.put_off and not memory.settle_s
        put_off, memory.put_off = memory.put_off, defer
        if due and not memory.put_off:
            memory.probing = True
            self._deferrable = not put_off
            return self._switch()
        return self._run(mode, self._span())

    def _probed_by(self) -> int:
        """Batches the probe under way will have measured once the window just ended counts."""
        return 0 if self._settling else self._probed + self._length

    def _put_off(self) -> tuple[bool, int]:
        """The epoch ends before the probe begun in it has measured `PEEK` batches: it is put
        off, as one due at the epoch's end, to after the incumbent's first window of the next
        epoch. Carried over, it would be weighed there against a figure from this epoch's end
        (a ramp begins again at its foot). The stage is not asked to switch back: no batch is
        left to make in this epoch, and the next starts in the incumbent's mode."""
        memory = self.memory
        memory.probing = memory.carried = False
        memory.put_off = True  # still due: it begins after the next epoch's first window
        self._settling = False
        return self._run(self.threaded, self._span())

    def _changed(self, period: float, level: float, wait: int, slowed: bool = False) -> None:
        """The loop changed, from ``level`` to ``period`` a batch: probe the other mode once
        ``wait`` more windows have been measured (0: at this window's end), unless the loop
        came back to a level it was at before, in the same mode, where the probes were decided
        already: the pacing there goes on where it was.

        Where the loop ``slowed`` to the new level from a probe of the other mode just lost
        and faster than the loop's first window after it (a ramp climbing through the probe, or
        a step just after it: the windows cannot tell which), the level's pacing goes on from a
        probe at once. That loss may have been to the move, and so may the one the level
        remembers: a ramp begins again each epoch and climbs through its probes the same way,
        and the grid's numpy ramp kept the loop alone for whole runs, its pacing restored at
        the ramp's top every epoch from losses to the climb.

        Back at the level before the last change, whatever its probes said (an evaluation
        phase; phases of short and long steps). Back at an older one (the nearest, within
        `CHANGED`), only if its last probe was decided: the other mode, probed or left, slower
        by more than `KNOWN` than the incumbent and, where a probe was lost while the loop
        slowed, than the incumbent where it ran, read off the line through its windows either
        side (see `_lost_to_a_move`). A loop that moves steadily passes a level again only
        after the whole of its move (the same ramp in the next epoch), and a narrow loss
        there, or one to the move, may say nothing of the other mode; a loss beyond `KNOWN`
        where the probe ran does.
        """
        memory = self.memory
        if memory.settle_s:  # the loop's pace drifts that far there: a drift, not a change
            memory.smooth = memory.reference = memory.last = period
            return
        mode = memory.threaded
        left = Level(
            mode,
            level,
            memory.backoff,
            memory.since,
            memory.spread / level,
            memory.lost_by,
            memory.stayed,
        )
        seen = _nearest(memory.levels, period)
        memory.visited, memory.stayed = (0 if seen is None else seen.stayed), 0
        memory.smooth = memory.reference = memory.last = period
        back = _nearest(
            (
                known
                for n, known in enumerate(memory.levels)
                if known.threaded == mode and (n == 0 or known.lost_by > KNOWN)
            ),
            period,
        )
        others = [
            known
            for known in memory.levels
            if known is not back and not (known.threaded == mode and _near(known.period, level))
        ]
        memory.levels = [left, *others][:LEVELS]  # the level left, as it stands now
        memory.lost_by = 0.0
        if back is not None:
            memory.backoff, memory.since, memory.lost_by = back.backoff, back.since, back.lost_by
            memory.spread = back.stray * period
            if slowed:  # due by this window's end
                memory.since = max(memory.since, memory.backoff - 1 - wait)
            return
        memory.spread *= period / level  # its windows stray as much, for their length
        memory.backoff, memory.since = 1, -wait  # counted up to 1 by this window's end

    def cut(self, length: int) -> None:
        """The window just answered is ``length`` batches long, not what `window` said: the
        stage ends it sooner, with the epoch, or counts the loop's batches over a longer one
        (a counted window, where the loop makes its batches fast). A probe counts it as such,
        and so does the loop's stay at its level (see `_worth_leaving`)."""
        self._length = length

    def _probe(self, period: float, ending: bool = False) -> tuple[bool, int]:
        """Part of the probe's measured window ended: decide if the window is whole, or if its
        batches so far are slower than the incumbent beyond doubt; otherwise measure on.

        Beyond doubt: slower by more than `MARGIN` plus twice as far as the incumbent's windows
        stray, scaled to the fewer batches (the mean of 4 strays about twice as far as that of
        16), so that uneven steps do not end a probe that could still win.
        """
        self._probed += self._length
        self._probed_s += period * self._length
        period = self._probed_s / self._probed
        memory = self.memory
        span = self._span()
        if ending and self._drained() and not memory.carried and self._wins(period):
            memory.carried = True  # measured again from its settling in the next epoch
            return self._run(self.threaded, span)
        if self._probed < span and not (ending and self._probed >= PEEK):
            if memory.settle_s:  # measured whole there: no look before its end
                return self._run(self.threaded, span - self._probed)
            noise = memory.spread * math.sqrt(span / self._probed)
            if period <= memory.smooth * (1 + MARGIN) + 2 * noise:
                return self._run(self.threaded, span - self._probed)
        return self._decide(period)

    def _drained(self) -> bool:
        """Whether the window that ends the epoch is the thread's, and so drains what the
        thread made ahead: weighed alone, it flatters the thread. A probe of the thread may lose
        on it, but a probe that would win on it is measured again in the next epoch, once,
        from its settling there (`Memory.carried`). The incumbent thread's is not counted in
        its figure, unless it is the only window after the thread's settling: then it is
        weighed with that, as one. It is never weighed with the next epoch's settling: the
        next epoch's first batches need not be the loop its last were (a ramp begins again).

        At an epoch's end the thread hands over what it made ahead, with nothing to make
        after it; where its work holds the GIL, the loop no longer waits for the thread to
        let go of it either. Both were paid for where the thread began: its queue filled, and
        the loop waited for the GIL that the new thread took. In the grid's pure-Python loop
        (10 ms of data, 20 us steps, 25 batches an epoch), the thread's first hand-over of an
        epoch came 6 ms late and its last 3.4 ms early. In two traces, its last 3 or 4 batches
        of an epoch ran at 8.4 to 10.4 ms a batch, mostly under 9.5; its other windows at 10.2
        to 11.1 ms, and the loop alone's at 9.6 to 10.5 ms. The thread took over on a probe
        that ended an epoch, each epoch's last window kept its figure low, and it was kept in
        54 of 56 epochs (0.955x plain; 3 of 56 and 0.972x now, in the same runs:
        ``benchmarks/kept_alone.py --cell python,10000,20``).

        Where the loop settles slowly, windows end with the epoch anyway, and a probe is
        measured over a whole epoch (see `SLOW_SETTLE_S`): not there.
        """
        return self.threaded and not self.memory.settle_s

    def _span(self) -> int:
        """Batches in a measured window: `WINDOW`, or where the loop settles slowly, as many
        as it runs in `SLOW_WINDOW_S` at its pace: the stage ends it with the epoch, sooner."""
        return self._batches_in(SLOW_WINDOW_S) if self.memory.settle_s else WINDOW

    def _batches_in(self, seconds: float) -> int:
        """Batches the loop runs in ``seconds`` at its pace (the incumbent's figure, or before
        it has one, the last window's), `WINDOW` at least."""
        memory = self.memory
        pace = memory.smooth if memory.smooth > 0 else memory.seen
        return max(WINDOW, math.ceil(seconds / pace)) if pace > 0 else WINDOW

    def _decide(self, period: float) -> tuple[bool, int]:
        """The probe's window ended: keep the faster mode; look again later, the later the
        clearer the answer."""
        memory = self.memory
        memory.probing = memory.carried = False
        memory.since = 0
        memory.held = math.nan
        incumbent = memory.smooth
        clear = max(period, incumbent) > (1 + CHANGED) * min(period, incumbent)
        won = self._wins(period)
        if won and self._worth_leaving(period, incumbent):  # it is the incumbent now
            memory.threaded, memory.backoff = self.threaded, (CLEAR_GROWTH if clear else 1)
            self._spans = ()
            memory.lost_by = incumbent / period - 1
            memory.spread *= period / incumbent  # its windows stray alike, for their length
            memory.smooth = memory.reference = memory.last = period
            return self._run(self.threaded, self._span())
        # What the probe cost, in batches of the incumbent: the next waits until that is at most
        # PROBE_BUDGET of the loop's time since (the settling batches are taken to cost alike).
        self._cost = (period / incumbent - 1) * (self._probed + self._settled)
        # Kept out though faster, it is not weighed again: it was weighed against nothing else.
        # Where the probe's measured batches were, and the incumbent's windows before them; a
        # probe carried over from the last epoch has none of its own: the figure's window then,
        # taken to sit as far before the probe as the window after it will (a plain mean).
        middle = self._at - self._probed / 2
        spans = self._spans or (Span(math.nan, memory.last),)
        self._lost = (math.nan, math.nan, ()) if won else (period, middle, spans)
        memory.lost_by = period / incumbent - 1
        self._grown = (CLEAR_GROWTH if clear else 2) * memory.backoff
        self._pace()
        memory.reference = incumbent
        return self._switch()

    def _wins(self, period: float) -> bool:
        """Whether a probe at ``period`` a batch beats the incumbent's smoothed figure: by
        more than the incumbent's windows stray, or a noisy loop would flip on a lucky
        window."""
        memory = self.memory
        return period < memory.smooth * (1 - max(MARGIN, memory.spread / memory.smooth))

    def _worth_leaving(self, period: float, incumbent: float) -> bool:
        """Whether the probe that beat the incumbent, at ``period`` a batch against
        ``incumbent``, gains more here than taking over costs where the loop goes back.

        A loop that goes back and forth between two levels (phases of short and long steps)
        returns to the level before its last change in the mode it took here, and runs there
        for about `LAG` batches before the stage sees it and probes. Where the incumbent won
        there, that return costs its win, for those batches; taking over gains the probe's
        lead for as long as the loop stays here, told from its last visit (or its stay so far,
        if longer). Phases of 64 batches, the thread winning the long steps by 0.35 ms a batch
        and losing the short ones by 0.05 ms, then keep the thread throughout; phases long
        enough to pay for the lag are followed. A level not visited before (a warm-up, a
        ramp's first epoch) is followed. The other mode's loss there counts less the margin
        the incumbent had to win by, and as twice as slow at most: a probe won while the loop
        moved under it can read as far more. `LAG` is the least the return costs: where the
        loop alone makes its batches under 1 ms, its windows are counted over about 20 ms, and
        a return is seen later still.
        """
        memory = self.memory
        if not memory.visited:  # set only from a level `levels` held, so it holds one
            return True
        there = memory.levels[0]
        # What the incumbent won by there beyond doubt (see `_decide`'s margin).
        won_by = min(there.lost_by, 1.0) - max(MARGIN, there.stray)
        if there.threaded != memory.threaded or won_by <= 0:
            return True
        gain = (incumbent - period) * max(memory.visited, memory.stayed)
        return gain > won_by * there.period * LAG

    def _lost_to_a_move(self, after: Span) -> bool:
        """Whether the probe just lost would have won against the incumbent's windows either
        side of it, ``after`` being the first since: the loop slowed while the probe ran (a
        warm-up, growing steps), so the figure it was weighed against was from the past.

        The incumbent's pace where the probe ran is read off the line through the windows
        either side, at the middle of the probe's measured batches: that takes a steady move
        out, as the smoothed figure, which trails such a loop by about three windows' move,
        cannot, and as their plain mean can only where the probe sits halfway between them.
        A loader's epoch of the grid's numpy ramp opened with a window of 73 batches: their
        mean put the probe of the thread about 15 batches too early on the climb, and the thread,
        faster at every step of the ramp, lost. Where ``after`` is far off the figure, a move
        and a step just after the probe look alike: the move is taken only where the window
        before the last one says the loop was moving at about that pace already (`STEADY`).
        Where the loop slowed, the loss the level remembers (``lost_by``) is capped by the
        probe's against that line, or where ``after`` is far off and the move not taken, against
        ``after``."""
        probe, middle, spans = self._lost
        self._lost = (math.nan, math.nan, ())
        if not spans or not spans[-1].period < after.period:  # no probe lost, or no slowing
            return False
        # Lost by as much as it is slower than the incumbent where it ran, at most, or where
        # that is not known, than the incumbent after it: a loss to the loop's move is no
        # answer for the level (see `_changed`), however far the move.
        memory = self.memory
        if self._far_off(after.period) and not _steady(spans, after):
            memory.lost_by = min(memory.lost_by, probe / after.period - 1)
            self._slowed = probe < after.period  # the change it may be comes with a probe
            return False
        level = _along(spans[-1], after, middle)
        memory.lost_by = min(memory.lost_by, probe / level - 1)  # where the probe ran
        return probe < level * (1 - max(MARGIN, memory.spread / level))

    def _far_off(self, period: float) -> bool:
        """Whether a window of the incumbent is too far off its figure to count in it (see
        `STRAY`): a pause of the machine, or the loop changed."""
        smooth = self.memory.smooth
        return abs(period - smooth) > max(CHANGED * smooth, STRAY * self.memory.spread)

    def _take_over(self) -> tuple[bool, int]:
        """The mode just probed takes over, its figure to be set from its first window."""
        memory = self.memory
        memory.threaded = not self.threaded
        self._spans = ()
        memory.lost_by = 0.0
        memory.smooth = memory.reference = memory.last = memory.held = math.nan
        memory.backoff, memory.since = 1, 0
        return self._switch()

    def _pace(self, extra: float = 0.0) -> None:
        """Set the wait for the next probe from the last lost one's: its growth, and what it
        cost (plus ``extra`` batches' time) spread at `PROBE_BUDGET` over the windows until."""
        self._cost += extra
        # Where the loop settles slowly, windows end with the epoch: the probe's is their length.
        window = self._probed if self.memory.settle_s and self._probed else self._span()
        paid = math.ceil(self._cost / (PROBE_BUDGET * window))
        self.memory.backoff = min(max(self._grown, paid), MAX_BACKOFF)

    def _switch(self) -> tuple[bool, int]:
        self.threaded = not self.threaded
        self.switches += 1
        return self._settle(switched=True)

    def _settle(self, switched: bool = False) -> tuple[bool, int]:
        """A settling window, not measured: the thread's queue fills (`SETTLE`), or the loop
        takes its first batch itself (`SETTLE_INLINE`); after a switch, in a loop that settles
        slowly, for its settling time (`SLOW_SETTLE_S`), or what an epoch's end left of it."""
        self._settling = True
        memory = self.memory
        length = SETTLE if self.threaded else SETTLE_INLINE
        if memory.settle_left:
            length, memory.settle_left = max(length, memory.settle_left), 0
        elif switched and memory.settle_s:
            length = max(length, self._batches_in(memory.settle_s))
        self._settled_slowly = bool(memory.settle_s) and switched
        self._settled = length
        return self._run(self.threaded, length)

    def _run(self, threaded: bool, length: int) -> tuple[bool, int]:
        """The answer: the next window's mode and length, kept to measure the window by."""
        self._length = length
        return threaded, length


def _along(before: Span, after: Span, middle: float) -> float:
    """The time per batch at batch ``middle`` on the line through two windows; halfway
    between them where ``before``'s place is not known."""
    share = (middle - before.middle) / (after.middle - before.middle)
    if math.isnan(share):
        share = 0.5
    return before.period + (after.period - before.period) * share


def _steady(spans: tuple[Span, ...], after: Span) -> bool:
    """Whether the incumbent's windows ``spans`` (two) and ``after`` lie on a steady move:
    the loop slowing from the first to the second at a pace within `STEADY` times its pace
    from the second to ``after``."""
    if len(spans) < 2:
        return False
    first, last = spans
    before = (last.period - first.period) / (last.middle - first.middle)
    since = (after.period - last.period) / (after.middle - last.middle)
    return since / STEADY <= before <= since * STEADY


def _nearest(levels: Iterable[Level], period: float) -> Level | None:
    """The level of ``levels`` nearest to ``period`` a batch, if one is within `CHANGED`."""
    return min(
        (known for known in levels if _near(known.period, period)),
        key=lambda known: abs(period / known.period - 1),
        default=None,
    )


def _near(level: float, period: float) -> bool:
    """Whether a loop at ``period`` a batch is at ``level`` still, within `CHANGED`."""
    return abs(period / level - 1) <= CHANGED


def settle_for(workers: int, cpus: int | None = None) -> float:
    """How long a switch of mode takes to settle (`Memory.settle_s`) in a loop fed by
    ``workers`` DataLoader worker processes, with ``cpus`` CPUs usable (by default, this
    process's): `SLOW_SETTLE_S` where the workers are as many as the CPUs or more, 0 otherwise.

    Examples:
        >>> settle_for(2, cpus=2), settle_for(1, cpus=2), settle_for(0, cpus=1)
        (0.5, 0.0, 0.0)
    """
    if cpus is None:
        cpus = _usable_cpus()
    return SLOW_SETTLE_S if workers > 0 and workers >= cpus else 0.0


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity to ask
        return os.cpu_count() or 1


def _thread_may_help(period: float, means: Callable[[], tuple[float, float]]) -> bool:
    """Whether, inline, a thread could hide more per batch than any hand-off costs."""
    if period < 2 * HIDE_AT_LEAST_S:  # the cheap answer for a loop with no work
        return False
    step, wait = means()
    return min(step, wait) >= HIDE_AT_LEAST_S
