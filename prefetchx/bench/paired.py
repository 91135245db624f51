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
"""

from __future__ import annotations

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
    def verdict(self) -> str:
        """For a ratio over a baseline: ``faster`` or ``slower`` when every round agrees and
        the median is at least `CLEAR` away from 1.0, else ``same``."""
        if self.low > 1.0 and self.median >= 1.0 + CLEAR:
            return "faster"
        if self.high < 1.0 and self.median <= 1.0 - CLEAR:
            return "slower"
        return "same"


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
