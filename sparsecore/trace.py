"""Stage timing across threads: what ran where, and when (for the pipeline's trace).

A ``StageTrace`` collects ``(stage, lane, start, end)`` intervals: the lane is
the thread of work (the training loop, the SparseCore executor, the input
distribution), the stage what ran. Overlap shows as a wall time below the sum
of the stages' durations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class Interval:
    stage: str
    lane: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class StageTrace:
    """Thread-safe list of stage intervals (``time.perf_counter`` seconds)."""

    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def stage(self, stage: str, lane: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self.intervals.append(Interval(stage, lane, start, end))

    def wrap(self, fn: Callable[..., Any], stage: str, lane: str) -> Callable[..., Any]:
        """``fn`` timed as ``stage`` on ``lane`` whenever it runs."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.stage(stage, lane):
                return fn(*args, **kwargs)

        return timed

    def clear(self) -> None:
        with self._lock:
            self.intervals.clear()

    def summary(self, timeline: bool = False) -> dict[str, Any]:
        """Wall time from the first start to the last end, and seconds per stage; with
        ``timeline``, also every interval as (stage, lane, start, end) in seconds from the
        first start (for a plot)."""
        with self._lock:
            intervals = list(self.intervals)
        if not intervals:
            return {"wall_s": 0.0, "stage_s": {}, "sum_of_stages_s": 0.0} | ({"intervals": []} if timeline else {})
        per_stage: dict[str, float] = {}
        for i in intervals:
            per_stage[f"{i.lane}: {i.stage}"] = per_stage.get(f"{i.lane}: {i.stage}", 0.0) + i.seconds
        first = min(i.start for i in intervals)
        summary = {"wall_s": max(i.end for i in intervals) - first, "stage_s": per_stage,
                   "sum_of_stages_s": sum(per_stage.values())}
        if timeline:
            summary["intervals"] = [(i.stage, i.lane, i.start - first, i.end - first) for i in intervals]
        return summary
