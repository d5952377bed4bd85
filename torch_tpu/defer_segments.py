"""DeferAndFuse's segments: the ops between two materializations, recorded or run eagerly.

Recording an op costs Python time (20-50 us: the dispatch mode, the graph's
bookkeeping), about what Strict spends running a small op, so a graph that
compiles to little gain - or runs op by op - makes a step slower than
Strict. Which is faster can only be measured: the whole cycle (recording,
the user's code in between, the graph's run) against the same ops run
eagerly, as Strict would.

A *segment* is the sequence of ops DeferAndFuse saw (by OpOverload) from one
materialization of a graph to the next: a training step that ends in a sync
point, the period the repeat detector cuts. Once a segment has run recorded
``MIN_SETTLED_RUNS`` times with its graph settled (compiled and its runner
chosen, or never to be compiled - a graph new every time, its scalars
changing, is never compiled), its next occurrences go through a
TimedChoice between recorded and eager - predicted from which segment
followed the last one, each op checked against the prediction as it comes.
An eager segment runs Strict's kernels on real memory, op by op, recording
nothing; an op that departs from the prediction ends it, and recording
starts there. Either way the results are Strict's (op-by-op replay and eager
run the same kernels) or the compiled graph's, as before.

Checking each op still passes it through the dispatch mode, which costs a
small-op step about as much again as Strict's kernels. So a segment that
ends at a *host boundary* - ``torch.tpu.synchronize()``, where the host
paces or times its steps - and is chosen eager (untimed) runs *dormant*: the
mode leaves the thread at the boundary before it, nothing watches its ops,
and the boundary that ends it - the k-th since it began, k counted on its
recorded runs - brings the mode back (or keeps it away, when the next
segment is dormant too). Nothing is pending while a segment runs eagerly, so
a dormant segment is exactly Strict, whatever ops it turns out to run; only
the prediction of what follows it rests on its ops being the expected ones.

A step that calls the SparseCore engine or a collective is cut into several
segments there, inside an op, where the mode cannot leave, so none of them
could run dormant alone. The segments predicted from a host boundary to the
next - a *chain*: none but the last saw a host boundary of the kind that ends
the last (synchronize, mark_step: kinds are counted apart), each is settled
with its choice made - can run dormant together: the mode leaves at the
boundary before the first and comes back at the one that ends the last.
Whether a chain runs dormant or as each of its segments chose (the mode on)
is a TimedChoice of its own, timed from boundary to boundary: a segment's own
eager runs are timed with the mode on, and so would never show what running
without it saves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu.timed_choice import TimedChoice

RECORDED, EAGER = 0, 1
AS_PLANNED, DORMANT = 0, 1  # a chain's variants
# Ops autograd issues on pending tensors and not on real ones (or the other
# way round): metadata only, so they run as they come in an eager segment and
# are not part of a segment's ops.
UNMATCHED = frozenset([torch.ops.aten.detach.default, torch.ops.aten.alias.default])
# The copies autograd makes of a gradient whose recorded strides (from a meta kernel)
# differ from its parameter's: a recorded segment has them, the same one run eagerly may not.
AUTOGRAD_COPIES = frozenset([torch.ops.aten.new_empty_strided.default, torch.ops.aten.copy_.default])
LOOKAHEAD = 8  # recorded ops an eager segment may skip at once (see Segments.advance_to)


@dataclass(slots=True, eq=False)
class _Segment:
    ops: tuple
    settled_runs: int = 0
    choice: TimedChoice | None = None
    end_reason: str | None = None  # what materialized its last recorded run
    # When that was a host boundary: the k-th of its kind (synchronize, mark_step) since
    # the segment began. None: it ended elsewhere.
    host_boundaries: int | None = None
    # The kinds of host boundary its last recorded run saw, when it ended elsewhere (inside
    # an op: a SparseCore kernel, a collective): a chain ending at another kind can go on past it.
    seen: frozenset[str] = frozenset()


class Segments:
    """The current segment, what followed what, and the recorded-or-eager choice per segment."""

    MIN_SETTLED_RUNS = 16  # recorded runs with a settled graph before a segment's choice starts
    MAX_CHAIN = 8  # segments run dormant together, from a host boundary to the next
    MAX_KNOWN = 1000  # segments remembered (a loop whose segments never recur would grow without end)

    def __init__(self, max_ops: int) -> None:
        self.max_ops = max_ops  # a longer log is no segment worth choosing for (no graph that long)
        self.log: list[Any] = []  # the ops of the current segment, while it is recorded
        self.eager: _Segment | None = None  # the segment running eagerly now
        self.pos = 0  # its next op
        self.dormant: _Segment | None = None  # the segment running eagerly with the mode away (a chain's last)
        self._dormant_before: tuple[_Segment, ...] = ()  # the chain's segments before it
        self.boundaries: dict[str, int] = {}  # host boundaries since the current segment began, by kind
        self.known: dict[tuple, _Segment] = {}
        self.followed_by: dict[tuple, tuple] = {}
        self._last: tuple | None = None
        self._start: float | None = None  # when the current segment began; None: not to be timed
        self._timed: tuple[_Segment, int] | None = None  # the (segment, variant) the current run times
        self.chains: dict[tuple[_Segment, ...], TimedChoice] = {}  # a chain's dormant-or-as-planned choice
        self._chain_timed: tuple[tuple[_Segment, ...], int, float] | None = None  # (chain, variant, start)

    # ---- recorded segments ----

    def log_op(self, func: Any) -> None:
        """``func`` comes to the recording (recorded or run eagerly there)."""
        if func in UNMATCHED:
            return
        log = self.log
        log.append(func)
        if len(log) > self.max_ops:
            log.clear()
            self._start = self._last = None

    def materialized(self, settled: bool, reason: str, at_host_boundary: bool = False,
                     new_graph: bool = False) -> None:
        """A recorded segment ends: its graph ran; ``settled``: as it will from now on;
        ``reason``: what materialized it; ``at_host_boundary``: at one (counted already by
        ``count_host_boundary``); ``new_graph``: the graph ran for the first time.

        A segment seen before whose graph is new again - its ops the same, a scalar
        argument not (a plain AdamW's bias corrections, a scheduled lr) - replays op
        by op, never compiled, and will each time: that run is settled too, so the
        segment gets its recorded-or-eager choice rather than recording forever."""
        ops = tuple(self.log)
        self.log = []
        boundaries = self.boundaries
        settled = settled or (new_graph and ops in self.known)
        segment = self._ended(ops, RECORDED, settled)
        if segment is not None:
            segment.host_boundaries = boundaries.get(reason, 0) if at_host_boundary else None
            segment.seen = frozenset() if at_host_boundary else frozenset(k for k, n in boundaries.items() if n > 0)
            segment.end_reason = reason

    # ---- dormant segments ----

    def count_host_boundary(self, kind: str) -> None:
        """A host boundary of this kind comes (before it materializes anything). Kinds
        are counted apart, so a synchronize after each step's mark_step (a caller timing
        its steps) neither ends a dormant chain that mark_step began nor keeps one from
        forming."""
        self.boundaries[kind] = self.boundaries.get(kind, 0) + 1

    def after_host_boundary(self, may_sleep: bool) -> tuple[bool, list[tuple[_Segment, bool]]]:
        """A host boundary has materialized what was pending: it ends the dormant
        chain or eager segment whose recorded runs ended at this boundary (the ops
        an eager segment still expects are the ones autograd issues only on pending
        tensors, see advance_to). Returns whether the segments to come (or still
        running) are dormant - a chain (see the module docstring) that has not
        begun, ``may_sleep``: the mode can leave the thread - and the segments that
        ended eagerly here, each with whether it ran dormant."""
        ended: list[tuple[_Segment, bool]] = []
        for running in (self.dormant, self.eager if self.pos > 0 else None):
            if running is None or running.host_boundaries is None:
                continue
            if self.boundaries.get(running.end_reason, 0) < running.host_boundaries:
                return running is self.dormant, ended
            dormant = running is self.dormant
            chain = (*self._dormant_before, running) if dormant else (running,)
            self.dormant, self._dormant_before, self.eager = None, (), None
            for j, segment in enumerate(chain):
                if j:  # planned by the one before (eager, untimed), as it ran
                    self.eager = self._timed = None
                self._ended(segment.ops, EAGER, False)
                ended.append((segment, dormant))
        if may_sleep and (self.eager is None or self.pos == 0) and self._timed is None and not self.log:
            chain = self._chain_ahead()
            if chain and self._runs_dormant(chain):
                self.eager = None
                self.dormant, self._dormant_before = chain[-1], chain[:-1]
                return True, ended
        return False, ended

    def _chain_ahead(self) -> tuple[_Segment, ...]:
        """The segments predicted from here to the next host boundary, when they can run
        dormant (see the module docstring; the first planned already, untimed); else ()."""
        chain: list[_Segment] = []
        segment = self.known.get(self.followed_by.get(self._last))
        while segment is not None and segment not in chain and len(chain) < self.MAX_CHAIN:
            choice = segment.choice  # the first's next run is planned already
            if choice is None or (chain and choice.peek()[1]):
                return ()  # its next run is to be timed (as every run while it is still choosing)
            chain.append(segment)
            if segment.host_boundaries is not None:
                # What ends the chain: none before may have seen a boundary of that kind.
                return tuple(chain) if not any(segment.end_reason in s.seen for s in chain[:-1]) else ()
            segment = self.known.get(self.followed_by.get(segment.ops))
        return ()

    def _runs_dormant(self, chain: tuple[_Segment, ...]) -> bool:
        """A lone segment runs dormant when it is planned eager; a longer chain when its
        own choice says so, at a boundary where a segment has just ended (not at a
        second boundary in a row)."""
        if len(chain) == 1:
            return chain[0] is self.eager
        if any(self.boundaries.values()):
            return False
        choice = self.chains.get(chain)
        if choice is None:
            choice = self.chains[chain] = TimedChoice(f"DeferAndFuse chain of {len(chain)} segments",
                                                      ("as planned", "dormant"))
        variant, timed = choice.next()
        self._chain_timed = (chain, variant, time.perf_counter()) if timed else None
        return variant == DORMANT

    def interrupted(self) -> None:
        """DeferAndFuse was left (its pending graph run): the segment or chain running
        eagerly or dormant ends untimed, and nothing runs or is timed across the gap
        (the last segment is remembered: the first after re-entering is predicted)."""
        self.dormant, self._dormant_before, self.eager, self.pos = None, (), None, 0
        self._start = self._timed = self._chain_timed = None
        self.boundaries = {}

    # ---- eager segments ----

    def advance_to(self, func: Any) -> bool:
        """Whether ``func`` is the eager segment's next op - or one of the few after
        it, which the segment then moves to, skipping the ones between: autograd
        copies a gradient whose recorded strides (from a meta kernel) differ
        from its parameter's (new_empty_strided, copy_), which the real
        kernel's output does not need."""
        ops, pos = self.eager.ops, self.pos
        if ops[pos] is func:
            return True
        for j in range(pos + 1, min(pos + 1 + LOOKAHEAD, len(ops))):
            if ops[j] is func:
                self.pos = j
                return True
        return False

    def ran_eagerly(self) -> bool:
        """The expected op ran; whether it ended the segment."""
        segment = self.eager
        if segment is None:  # ended meanwhile, by a materialization on another thread
            return False
        self.pos += 1
        if self.pos < len(segment.ops):
            return False
        self.eager = None
        self._ended(segment.ops, EAGER, False)
        if segment.host_boundaries is not None:
            # The boundary that ended its recorded runs is still to come.
            self.boundaries = {segment.end_reason: -1}
        return True

    def ends_eagerly_at(self, reason: str) -> bool:
        """A materialization with nothing pending, not at a host boundary (see
        after_host_boundary for those): whether it ends the eager segment running -
        one whose recorded runs ended at the same kind, with only autograd's copies
        of pending gradients left of its ops. A segment ended inside an op reaches
        that op past the copies (advance_to); one ended by a call outside ops (work
        submitted to a stream, a materialization hook) would otherwise never end."""
        segment = self.eager
        if (segment is None or self.pos == 0 or segment.end_reason != reason
                or not AUTOGRAD_COPIES.issuperset(segment.ops[self.pos:])):
            return False
        self.eager = None
        self._ended(segment.ops, EAGER, False)
        return True

    def diverged(self) -> None:
        """An op other than the expected came (or the expected one failed): the
        rest of the segment is recorded, untimed."""
        self.log = list(self.eager.ops[:self.pos])
        self.eager = None
        self._start = self._timed = self._chain_timed = None

    # ----

    def _ended(self, ops: tuple, variant: int, settled: bool) -> _Segment | None:
        """The segment of these ops ended (known or, recorded, now known); plans the next."""
        now = time.perf_counter()
        segment = self.known.get(ops)
        if segment is None and variant == RECORDED and ops:
            if len(self.known) >= self.MAX_KNOWN:
                self.known.clear()
                self.followed_by.clear()
                self.chains.clear()
            segment = self.known[ops] = _Segment(ops)
        chain_timed = self._chain_timed
        if chain_timed is not None:
            chain, chain_variant, start = chain_timed
            if segment is chain[-1]:
                self._chain_timed = None
                self.chains[chain].report(chain_variant, now - start)
            elif segment not in chain:
                self._chain_timed = None  # the run departed from the chain: its time tells nothing
        timed = self._timed
        if timed is not None and self._start is not None and timed[0] is segment and timed[1] == variant:
            segment.choice.report(variant, now - self._start)
        self._timed = None
        if segment is not None and variant == RECORDED and settled:
            segment.settled_runs += 1
        if self._last is not None:
            self.followed_by[self._last] = ops
        self._last, self._start = ops, now
        self.boundaries = {}
        self._plan(self.known.get(self.followed_by.get(ops)))
        return segment

    def _plan(self, upcoming: _Segment | None) -> None:
        """How the segment predicted to come next runs."""
        if upcoming is None or upcoming.settled_runs < self.MIN_SETTLED_RUNS:
            return
        if upcoming.choice is None:
            upcoming.choice = TimedChoice(f"DeferAndFuse segment of {len(upcoming.ops)} ops", ("recorded", "eager"))
        variant, timed = upcoming.choice.next()
        if timed:
            self._timed = (upcoming, variant)
        if variant == EAGER:
            self.eager, self.pos = upcoming, 0
