"""Choosing between two equivalent ways of running something by timing both.

A compiled graph against its op-by-op replay (torch_tpu.inductor), a
DeferAndFuse segment recorded against run eagerly (torch_tpu.defer): the two
variants compute the same thing, so the caller may run either and lets the
measurements decide.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class TimedChoice:
    """Which of two equivalent variants (0 and 1) runs next, by their measured times.

    The caller asks ``next()`` before each run and, when told to time it,
    reports the run's seconds with ``report``. The first runs alternate between
    the two (variant 0 first), all timed; once each has a warm-up run (not
    counted) and ``TRIALS`` timed ones, the faster by best time is chosen.

    A few timed runs can be misled by a noisy machine (a burst of other work
    makes either variant look up to twice as slow), so when the two came out
    within ``CLOSE`` of each other the choice is checked again now and then:
    one timed run of each, the best time of each so far decides. The checks
    grow rarer when they confirm the choice (every ``RECHECK_EVERY`` runs,
    then twice that, ...), so their cost - the slower variant run once - fades
    out. A clear choice is never timed again.
    """

    TRIALS = 3
    CALLS_TO_CHOOSE = 2 * (TRIALS + 1)  # each variant: a warm-up run, then TRIALS timed
    CLOSE = 2.0  # best-time ratio below which a choice is checked again
    # Runs after the choice until the first check ends, doubled after each check that confirms
    # the choice; at least 2, since a check is two timed runs. May be set on an instance.
    RECHECK_EVERY = 50

    def __init__(self, name: str, labels: tuple[str, str]) -> None:
        self.name = name
        self.labels = labels
        self.times: tuple[list[float], list[float]] = ([], [])
        self.chosen: int | None = None
        self._calls = 0
        self._recheck_every = 0  # set at the first choice
        self._until_check: int | None = None  # runs until the next check's end; None: no checks

    def next(self) -> tuple[int, bool]:
        """The variant to run next, and whether to time it (and ``report`` its time)."""
        upcoming = self.peek()
        if self.chosen is None:
            self._calls += 1
        elif self._until_check is not None:
            self._until_check -= 1
            if self._until_check < 0:  # the check's last run never reported (the caller dropped it)
                self._until_check = self._recheck_every
        return upcoming

    def peek(self) -> tuple[int, bool]:
        """What ``next()`` will return, without counting a call."""
        if self.chosen is None:
            return self._calls % 2, True
        if self._until_check in (1, 2):  # a check's two timed runs: the other variant, then the chosen
            return (1 - self.chosen if self._until_check == 2 else self.chosen), True
        return self.chosen, False

    def report(self, variant: int, seconds: float) -> None:
        """A timed run of ``variant`` took ``seconds``."""
        self.times[variant].append(seconds)
        if self.chosen is None:
            if min(len(self.times[0]), len(self.times[1])) > self.TRIALS:
                self._choose()
        elif self._until_check == 0:
            self._choose()

    def best(self, variant: int) -> float:
        return min(self.times[variant][1:])

    def _choose(self) -> None:
        first, second = self.best(0), self.best(1)
        previous = self.chosen
        self.chosen = 0 if first <= second else 1
        if previous == self.chosen:
            self._recheck_every *= 2  # the check confirmed the choice
        else:
            if previous is None:
                self._recheck_every = self.RECHECK_EVERY
            logger.info("%s: %s %.3f ms, %s %.3f ms: %s %s", self.name, self.labels[0], first * 1e3, self.labels[1],
                        second * 1e3, "runs" if previous is None else "checked again, now runs",
                        self.labels[self.chosen])
        close = max(first, second) < self.CLOSE * min(first, second)
        self._until_check = self._recheck_every if close else None
