"""Paired rounds: how the bench and the benchmark programs compare arms on a noisy machine.

Each round runs every arm once, back to back, and each arm's throughput is taken against the
baseline's *within the round*: a slow minute of the machine slows both sides of that round's
ratio, not one arm's median. The order changes from round to round so that no arm always runs
first, or always right after the same arm (`round_order`): an epoch can run faster or slower
for what ran just before it, and an order that only rotates puts each arm after the same one in
every round. On the 2-core VM that alone cost DataLoaderX, always right after plain, about 3%
in a pure-Python cell (`benchmarks/results/order-bias-cpu-2core.txt`). The figure reported is
the median of the per-round ratios with their spread (lowest and highest), over at least
`MIN_ROUNDS` rounds. Unpaired medians of three rounds let the machine's noise through: a loop
with nothing to overlap came out 1.04x to 1.3x "faster".

A median is read against a line (1.0, or a target) with its `uncertainty`: two standard errors
of the median, estimated from the rounds' own spread and from a plain DataLoader run against
itself in the same rounds, where the run has one (every difference there is noise). A median
that lies within it of the line is reported as too noisy to tell (`judge`, `compare`); where
plain against itself alone leaves a median more than `CLEAR` of noise, the machine was too busy
to tell a difference of `CLEAR` (`too_busy`): for 5 rounds, a standard deviation of its rounds
above 1.78% (``CLEAR * sqrt(n) / (2 * 1.2533)``), for 7 rounds 2.11%.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MIN_ROUNDS = 5
"""The fewest rounds a comparison is reported from."""

CLEAR = 0.02
"""A median ratio within this of 1.0 is no clear difference, whatever the spread."""


@dataclass(frozen=True)
class Spread:
    """A per-round figure: its median, lowest and highest value, and the values in order."""

    median: float
    low: float
    high: float
    rounds: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values``, one per round (at least one)."""
        if not values:
            raise ValueError("`values` must hold one value per round, got none.")
        return cls(statistics.median(values), min(values), max(values), list(values))

    def ratio(self) -> str:
        """As a throughput ratio: ``1.93x (1.85-1.99)``."""
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"

    @property
    def noise(self) -> float:
        """About the standard error of the median: ``1.2533 * stdev(rounds) / sqrt(rounds)``.

        The median of ``n`` draws of a normal spread ``sigma`` strays from the middle by about
        ``sqrt(pi / 2) * sigma / sqrt(n)`` (1.2533: the median's asymptotic efficiency; for 5
        rounds the exact figure is 4% lower). ``sigma`` is estimated from the rounds
        themselves. With fewer than 2 rounds nothing is known: infinite.
        """
        if len(self.rounds) < 2:
            return math.inf
        return MEDIAN_SE * statistics.stdev(self.rounds) / math.sqrt(len(self.rounds))


MEDIAN_SE = math.sqrt(math.pi / 2)
"""The standard error of a median over that of a mean, for normal noise, many draws."""


def uncertainty(value: Spread, noise: Spread | None = None) -> float:
    """How far ``value``'s median may stray by the machine's noise alone: two standard errors.

    Two estimates, the larger kept: ``value``'s own rounds, and ``noise``, where the run has
    it: a plain DataLoader against itself, whose every difference from 1.0 is noise. Two
    standard errors hold a normal median's true value about 95% of the time.
    """
    errors = [value.noise] + ([noise.noise] if noise is not None else [])
    return 2 * max(errors)


def judge(value: Spread, line: float, noise: Spread | None = None) -> str:
    """A target ``value >= line``: ``met``, ``not met`` or ``too noisy to tell``.

    Met when the median is at or above ``line`` by its `uncertainty` or more, not met when it
    is below by more than that, too noisy to tell when ``line`` lies within it.

    Examples:
        >>> judge(Spread.of([0.99, 1.00, 1.01, 1.00, 1.00]), 0.97)
        'met'
        >>> judge(Spread.of([0.90, 1.00, 1.10, 0.95, 1.05]), 0.97)
        'too noisy to tell'
        >>> judge(Spread.of([0.74, 0.75, 0.73, 0.74, 0.76]), 0.97)
        'not met'
    """
    band = uncertainty(value, noise)
    if value.median - band >= line:
        return "met"
    if value.median + band < line:
        return "not met"
    return "too noisy to tell"


def compare(ratio: Spread, noise: Spread | None = None) -> str:
    """A ratio over a baseline: ``faster``, ``slower``, ``alike`` or ``unsure``.

    Faster or slower when the median lies beyond 1.0 by `CLEAR` and by its `uncertainty`;
    alike when it lies within `CLEAR` of 1.0 and the uncertainty is at most `CLEAR` (the run
    could have seen a difference of `CLEAR`, and saw none); unsure otherwise: the rounds, or
    the machine's noise in ``noise``, varied too much to tell.

    Examples:
        >>> compare(Spread.of([1.90, 1.92, 1.93, 1.95, 1.91]))
        'faster'
        >>> compare(Spread.of([1.00, 1.01, 0.99, 1.00, 1.00]))
        'alike'
        >>> compare(Spread.of([0.80, 1.10, 0.60, 0.85, 1.05]))  # wide rounds either side
        'unsure'
        >>> compare(Spread.of([0.67, 1.10, 0.45, 0.69, 1.02]))  # wide, but a median far below
        'slower'
    """
    band = uncertainty(ratio, noise)
    beyond = max(CLEAR, band)
    if ratio.median >= 1.0 + beyond:
        return "faster"
    if ratio.median <= 1.0 - beyond:
        return "slower"
    return "alike" if band <= CLEAR else "unsure"


def too_busy(noise: Spread) -> bool:
    """Whether plain against itself (``noise``) strayed too much for a median to tell a
    difference of `CLEAR`: its `uncertainty` alone is above `CLEAR`.

    Examples:
        >>> too_busy(Spread.of([1.00, 0.99, 1.01, 1.00, 1.00]))
        False
        >>> too_busy(Spread.of([1.00, 0.95, 1.06, 0.97, 1.03]))
        True
    """
    return uncertainty(noise) > CLEAR


def round_order(arms: int, round_: int) -> list[int]:
    """The order of the arms (their indices) in round ``round_``: a Williams design.

    Every other round is the one before it reversed; the others follow the rows of a Latin
    square whose first row is ``0, 1, n-1, 2, n-2, ...``. Over ``2 * arms`` rounds each arm runs
    in each position twice, and right after each other arm twice; fewer rounds come close.
    """
    base = [0]
    low, high = 1, arms - 1
    while len(base) < arms:
        base.append(low)
        low += 1
        if len(base) < arms:
            base.append(high)
            high -= 1
    row = [(arm + round_ // 2) % arms for arm in base]
    return row[::-1] if round_ % 2 else row


def run_rounds(
    arms: Mapping[str, Callable[[], float]],
    rounds: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Run every arm once per round, interleaved, in the order `round_order` gives.

    Args:
        arms: Each arm's name and a call that runs it once and returns its time in seconds.
        rounds: How many rounds.
        progress: Called with the round's number (from 1) after each round.

    Returns:
        Each arm's times, one per round, in round order.
    """
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for index in round_order(len(names), r):
            times[names[index]].append(arms[names[index]]())
        if progress is not None:
            progress(r + 1)
    return times


def ratios(times: Mapping[str, Sequence[float]], base: str = "plain") -> dict[str, Spread]:
    """Each arm's throughput over ``base``'s, paired by round: ``base`` time over arm time.

    Above 1.0 the arm is faster. ``base`` itself gets exactly 1.0 in every round.
    """
    reference = times[base]
    out = {}
    for name, arm in times.items():
        if len(arm) != len(reference):
            raise ValueError(
                f"arm {name!r} has {len(arm)} rounds and {base!r} {len(reference)}; "
                "ratios pair them round by round."
            )
        out[name] = Spread.of([b / a for b, a in zip(reference, arm, strict=True)])
    return out
