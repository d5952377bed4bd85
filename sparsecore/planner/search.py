"""The search: a sharding type and devices per table, minimizing the slowest device's step time
under every device's HBM.

Tables go largest cost first; each takes the proposal — table-wise on one
device, column-wise over k devices, row-wise over all devices or one host's
(table-row-wise), data-parallel everywhere — that leaves the slowest device
fastest (then the one adding the least time, then the least memory), among
those that fit; then tables move off the slowest device while that lowers
it. When some table fits nowhere after that pass, a memory-first search
(``_pack``: largest need first, best fit, backtracking) looks for a placement
that fits at all before the plan is called infeasible. The lower bound (``_lower_bound``) is the least step time T for which
every table has a proposal no part of which exceeds T and the cheapest such
proposals' work, spread evenly, fits in T; the plan reports its gap to it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np

from sparsecore.distributed.plan import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    SHARDING_TYPES,
    TABLE_ROW_WISE,
    TABLE_WISE,
    ShardingPlan,
    TableSharding,
)
from sparsecore.planner.cost import EXCHANGES_PER_STEP, CostModel, ShardCost, Work, comm_seconds, shard_costs
from sparsecore.planner.specs import TableSpec
from sparsecore.planner.topology import Topology

MIN_COLUMN_WIDTH = 32


class PlanningError(ValueError):
    """No plan fits: names the tables, the bytes they need against what a device has, and what would help."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    sharding_types: tuple[str, ...] = SHARDING_TYPES
    ranks: tuple[int, ...] | None = None
    """Devices the table may use (table-wise: one of them; other types: all of them)."""

    def __post_init__(self) -> None:
        """Checks what a constraint can know without the topology (``plan_tables`` checks the
        ranks' range): a wrong value must be an error, not a silently different plan."""
        kinds = self.sharding_types
        if isinstance(kinds, str) or not isinstance(kinds, Sequence) or not kinds:
            raise ValueError(f"sharding_types={kinds!r}; expected a non-empty list of {list(SHARDING_TYPES)}")
        unknown = [k for k in kinds if not isinstance(k, str) or k not in SHARDING_TYPES]
        if unknown:
            raise ValueError(f"sharding type(s) {unknown} unknown; expected some of {list(SHARDING_TYPES)}")
        object.__setattr__(self, "sharding_types", tuple(kinds))
        if self.ranks is None:
            return
        if isinstance(self.ranks, str) or not isinstance(self.ranks, Sequence) or not self.ranks:
            raise ValueError(f"ranks={self.ranks!r}; expected a non-empty list of device numbers, or none "
                             f"(any device)")
        for r in self.ranks:
            # bool is an int, 1.0 indexes nothing: only true integers name a device.
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
                raise ValueError(f"rank {r!r} in ranks {list(self.ranks)}; expected a device number (an integer >= 0)")
        # A repeated rank would put two shards on one device, each checked alone against its HBM
        # (ShardingPlan.validate refuses such plans too).
        repeated = sorted({int(r) for r in self.ranks if list(self.ranks).count(r) > 1})
        if repeated:
            raise ValueError(f"ranks {list(self.ranks)} repeat rank(s) {repeated}; expected each device once")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))


@dataclasses.dataclass(frozen=True)
class Placement:
    table: str
    sharding_type: str
    ranks: tuple[int, ...]
    costs: tuple[ShardCost, ...]
    column_widths: tuple[int, ...] | None = None

    @property
    def hbm_bytes(self) -> int:
        """Over all its shards."""
        return sum(c.hbm_bytes for c in self.costs)

    @property
    def step_s(self) -> float:
        """Over all its shards."""
        return sum(c.step_s for c in self.costs)


@dataclasses.dataclass
class PlanResult:
    plan: ShardingPlan
    placements: list[Placement]
    device_bytes: np.ndarray
    device_compute_s: np.ndarray
    device_comm_s: np.ndarray
    capacity_bytes: int
    lower_bound_s: float
    planning_s: float
    device_work: list[Work]
    """Per device, its shards' work summed (the cost model's features)."""

    @property
    def device_step_s(self) -> np.ndarray:
        return self.device_compute_s + self.device_comm_s

    @property
    def max_step_s(self) -> float:
        return float(self.device_step_s.max())

    @property
    def gap(self) -> float:
        """How far the slowest device is above the lower bound (0.05: 5%)."""
        return self.max_step_s / self.lower_bound_s - 1 if self.lower_bound_s > 0 else 0.0


def _proposals(table: TableSpec, topology: Topology, batch: int, model: CostModel, allowed: Sequence[str],
               devices: Sequence[int]) -> list[tuple[str, list[tuple[int, ...]], list[ShardCost], tuple | None]]:
    """(type, device sets to choose among, per-shard costs, column widths) per allowed type."""
    n = len(devices)

    def costs(kind: str, shards: int, widths: tuple[int, ...] | None = None) -> list[ShardCost]:
        return shard_costs(table, kind, shards, topology, batch, model, widths)

    out = []
    if TABLE_WISE in allowed:
        out.append((TABLE_WISE, [(d,) for d in devices], costs(TABLE_WISE, 1), None))
    if COLUMN_WISE in allowed:
        k = 2
        while k <= n and table.embedding_dim % k == 0 and table.embedding_dim // k >= MIN_COLUMN_WIDTH:
            widths = (table.embedding_dim // k,) * k
            out.append((COLUMN_WISE, [], costs(COLUMN_WISE, k, widths), widths))
            k *= 2
    if ROW_WISE in allowed and n > 1:
        out.append((ROW_WISE, [tuple(devices)], costs(ROW_WISE, n), None))
    if TABLE_ROW_WISE in allowed and len(topology.hosts) > 1:
        size = len(topology.hosts[0])  # a last, smaller host (chips not a multiple) is left out
        hosts = [h for h in topology.hosts if len(h) == size and set(h) <= set(devices)]
        if hosts:
            out.append((TABLE_ROW_WISE, hosts, costs(TABLE_ROW_WISE, size), None))
    if DATA_PARALLEL in allowed and n == topology.chips > 1:
        out.append((DATA_PARALLEL, [tuple(devices)], costs(DATA_PARALLEL, n), None))
    return out


def device_baseline(tables: Sequence[TableSpec], topology: Topology, batch_size: int) -> tuple[int, Work]:
    """What every device carries whatever the plan: (bytes, work). Sharded over several
    devices, each receives its samples' pooled rows of every table (and their gradients) and
    takes part in every step's exchanges."""
    if topology.chips == 1:
        return 0, Work()
    local = batch_size / topology.chips
    received = sum(int(local * t.embedding_dim * 4 * 2) for t in tables)
    return received, Work(exchanges=EXCHANGES_PER_STEP)


class _Loads:
    """Every device's HBM bytes and step time as tables are placed."""

    def __init__(self, tables: Sequence[TableSpec], topology: Topology, batch_size: int, model: CostModel):
        """What every device carries before any table is placed (``device_baseline``)."""
        base_bytes, self.base_work = device_baseline(tables, topology, batch_size)
        self.base_s = comm_seconds(self.base_work, topology, model)
        self.used = np.full(topology.chips, base_bytes, dtype=np.int64)
        self.compute = np.zeros(topology.chips)
        self.comm = np.full(topology.chips, self.base_s)
        self.capacity = int(topology.hbm_bytes * (1 - model.reserved_fraction))

    def add(self, placement: Placement, sign: int = 1) -> None:
        index = np.array(placement.ranks)  # may repeat (column slices sharing a device): np.add.at
        np.add.at(self.used, index, [sign * s.hbm_bytes for s in placement.costs])
        np.add.at(self.compute, index, [sign * s.compute_s for s in placement.costs])
        np.add.at(self.comm, index, [sign * s.comm_s for s in placement.costs])

    def best_placement(self, table: TableSpec, proposals: list, constraint: Constraint,
                       remaining: float) -> tuple[tuple, Placement] | None:
        """(score, placement) of the proposal that leaves the slowest device fastest (then adds
        the least time, then the least memory) among those that fit; None if none fits."""
        load = self.compute + self.comm
        chips = len(load)
        best = None
        for kind, device_sets, costs, widths in proposals:
            need = np.array([s.hbm_bytes for s in costs])
            step = np.array([s.step_s for s in costs])
            for ranks in _candidate_sets(kind, device_sets, load, self.used, need, self.capacity, len(costs),
                                         constraint.ranks or tuple(range(chips))):
                after = load.copy()
                after[np.array(ranks)] += step
                # The slowest device now, or the average once the rest is placed at its cheapest:
                # spreading a table over every device (data_parallel) must pay for all it adds.
                projected = max(float(after.max()), (float(after.sum()) + remaining) / chips)
                score = (projected, float(step.sum()), int(need.sum()))
                if best is None or score < best[0]:
                    best = (score, Placement(table.name, kind, tuple(ranks), tuple(costs), widths))
        return best

    def rebalance(self, placements: dict[str, Placement], tables: Mapping[str, TableSpec],
                  options: Mapping[str, list], constraints: Mapping[str, Constraint], rounds: int) -> None:
        """Greedy order leaves some devices high: moves tables off the slowest device, one at a
        time, while that lowers it."""
        for _ in range(rounds):
            load = self.compute + self.comm
            slowest = int(load.argmax())
            peak = float(load[slowest])
            on_it = sorted((p for p in placements.values() if slowest in p.ranks),
                           key=lambda p: -p.costs[p.ranks.index(slowest)].step_s)
            for placement in on_it:
                self.add(placement, -1)
                best = self.best_placement(tables[placement.table], options[placement.table],
                                           constraints.get(placement.table, Constraint()), 0.0)
                if best is not None and best[0][0] < peak * (1 - 1e-9):
                    self.add(best[1])
                    placements[placement.table] = best[1]
                    break
                self.add(placement)
            else:
                return


def plan_tables(tables: Sequence[TableSpec], topology: Topology, batch_size: int, *,
                constraints: Mapping[str, Constraint] | None = None, model: CostModel = CostModel()) -> PlanResult:
    """The plan (see the module docstring); PlanningError when some table fits nowhere."""
    started = time.perf_counter()
    if not tables:
        raise PlanningError("no tables to plan")
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - {t.name for t in tables})
    if unknown:
        raise PlanningError(f"constraints name unknown tables {unknown}")
    chips = topology.chips
    state = _Loads(tables, topology, batch_size, model)
    if state.used.min() >= state.capacity:
        raise PlanningError(_baseline_over(state, topology, batch_size))
    options = {}
    for t in tables:
        c = constraints.get(t.name, Constraint())
        devices = c.ranks if c.ranks is not None else tuple(range(chips))
        outside = [d for d in devices if not 0 <= d < chips]
        if outside:
            raise PlanningError(f"table {t.name!r}: constraint ranks {outside} are out of range; expected "
                                f"0 <= rank < {chips} (the topology's chips)")
        options[t.name] = _proposals(t, topology, batch_size, model, c.sharding_types, devices)
        if not options[t.name]:
            raise PlanningError(f"table {t.name!r}: none of its allowed sharding types {list(c.sharding_types)} "
                                f"applies on {len(devices)} device(s)")
    lower_bound, cheapest = _lower_bound(options, state.base_s, chips)
    order = sorted(tables, key=lambda t: -cheapest[t.name])
    remaining = sum(cheapest.values())  # the least work the tables not placed yet will add
    placements, failed = {}, []
    for t in order:
        remaining -= cheapest[t.name]
        best = state.best_placement(t, options[t.name], constraints.get(t.name, Constraint()), remaining)
        if best is None:
            failed.append(t)
            continue
        state.add(best[1])
        placements[t.name] = best[1]
    if failed:
        # Placing for speed can strand memory that a packing for memory would use: search one.
        state = _Loads(tables, topology, batch_size, model)
        packed = _pack(tables, options, constraints, state)
        if packed is None:
            state = _Loads(tables, topology, batch_size, model)
            for placement in placements.values():
                state.add(placement)  # the greedy pass's loads, which the message reports
            raise PlanningError(_infeasible(failed, options, state.capacity, state.used, constraints, chips))
        placements = packed
    state.rebalance(placements, {t.name: t for t in tables}, options, constraints, rounds=min(len(tables), 200))
    return _result(tables, list(placements.values()), topology, state, lower_bound, started)


def _lower_bound(options: Mapping[str, list], base_s: float, chips: int) -> tuple[float, dict[str, float]]:
    """(the bound, each table's cheapest total cost). A plan whose slowest device takes T
    gives every table a proposal whose costliest part is at most T, and spreads the totals
    of those proposals over the chips: T >= max(part, sum of the cheapest such totals / chips).
    The bound is the least T that satisfies this (memory left aside), over what every device
    carries anyway."""
    events = sorted((max(s.step_s for s in p[2]), sum(s.step_s for s in p[2]), i)
                    for i, props in enumerate(options.values()) for p in props)
    best_total = [math.inf] * len(options)
    uncovered, spread, bound = len(options), 0.0, math.inf
    for part, total, i in events:  # T rising through every proposal's costliest part
        if total < best_total[i]:
            if best_total[i] == math.inf:
                uncovered -= 1
                spread += total
            else:
                spread += total - best_total[i]
            best_total[i] = total
        if not uncovered:
            bound = min(bound, max(part, spread / chips))
    return base_s + bound, dict(zip(options, best_total))  # after the sweep: each table's cheapest total


def _result(tables: Sequence[TableSpec], placements: list[Placement], topology: Topology, state: _Loads,
            lower_bound: float, started: float) -> PlanResult:
    by_name = {p.table: p for p in placements}
    plan = ShardingPlan(world_size=topology.chips, chip=topology.chip,
                        sparsecores_per_chip=topology.sparsecores_per_chip,
                        hosts=topology.hosts if len(topology.hosts) > 1 else None,
                        tables={t.name: TableSharding(sharding_type=by_name[t.name].sharding_type,
                                                      ranks=by_name[t.name].ranks,
                                                      column_widths=by_name[t.name].column_widths)
                                for t in tables})
    work = [state.base_work] * topology.chips
    for placement in placements:
        for rank, cost in zip(placement.ranks, placement.costs):
            work[rank] = work[rank] + cost.work
    return PlanResult(plan=plan, placements=[by_name[t.name] for t in tables], device_bytes=state.used,
                      device_compute_s=state.compute, device_comm_s=state.comm, capacity_bytes=state.capacity,
                      lower_bound_s=lower_bound, planning_s=time.perf_counter() - started, device_work=work)


def evaluate(plan: ShardingPlan, tables: Sequence[TableSpec], topology: Topology, batch_size: int, *,
             model: CostModel = CostModel()) -> PlanResult:
    """A given plan (written by hand, or another planner's) priced by the cost model as
    ``plan_tables`` prices its own; devices over capacity show in ``device_bytes``."""
    started = time.perf_counter()
    missing = sorted({t.name for t in tables} - set(plan.tables))
    if missing or plan.world_size != topology.chips:
        raise PlanningError(f"the plan does not cover these tables on {topology.chips} chips: missing {missing}, "
                            f"plan world size {plan.world_size}")
    # PlanError for a plan shard() would refuse: priced, it gives a wrong number or a crash.
    plan.validate_dims({t.name: t.embedding_dim for t in tables})
    state = _Loads(tables, topology, batch_size, model)
    placements = []
    for t in tables:
        sharding = plan.tables[t.name]
        costs = shard_costs(t, sharding.sharding_type, len(sharding.ranks), topology, batch_size, model,
                            sharding.column_widths)
        placements.append(Placement(t.name, sharding.sharding_type, tuple(sharding.ranks), tuple(costs),
                                    sharding.column_widths))
        state.add(placements[-1])
    options = {t.name: _proposals(t, topology, batch_size, model, SHARDING_TYPES, tuple(range(topology.chips)))
               for t in tables}
    lower_bound, _ = _lower_bound(options, state.base_s, topology.chips)
    return _result(tables, placements, topology, state, lower_bound, started)


PACKING_TRIES = 100_000
"""Placements the memory-first search tries before it gives up (a few seconds at most)."""


def _pack(tables: Sequence[TableSpec], options: Mapping[str, list], constraints: Mapping[str, Constraint],
          state: _Loads) -> dict[str, Placement] | None:
    """Every table placed within memory, found by a depth-first search (largest need first; for
    each, the placements that leave their devices least room first, as best-fit packing), with
    the placements added to ``state``; None, ``state`` as given, when none is found within
    PACKING_TRIES tries."""
    def need(t: TableSpec) -> int:
        return min(max(c.hbm_bytes for c in costs) for _, _, costs, _ in options[t.name])

    order = sorted(tables, key=lambda t: -need(t))
    chips = len(state.used)
    placed: list[Placement] = []
    levels = [iter(_packings(order[0], options[order[0].name], constraints, state, chips))]
    for _ in range(PACKING_TRIES):
        candidate = next(levels[-1], None)
        if candidate is None:  # no placement of this table fits after the ones above: back up
            levels.pop()
            if not levels:
                return None
            state.add(placed.pop(), -1)
            continue
        state.add(candidate)
        placed.append(candidate)
        if len(placed) == len(order):
            return {p.table: p for p in placed}
        t = order[len(placed)]
        levels.append(iter(_packings(t, options[t.name], constraints, state, chips)))
    for placement in placed:
        state.add(placement, -1)
    return None


def _packings(table: TableSpec, proposals: list, constraints: Mapping[str, Constraint], state: _Loads,
              chips: int) -> list[Placement]:
    """The table's placements that fit now, those leaving the least room on their devices first."""
    allowed = constraints.get(table.name, Constraint()).ranks or tuple(range(chips))
    fits = []
    for kind, device_sets, costs, widths in proposals:
        need = [c.hbm_bytes for c in costs]
        if kind == TABLE_WISE:
            sets = [r for r in device_sets if state.used[r[0]] + need[0] <= state.capacity]
        else:
            sets = _candidate_sets(kind, device_sets, state.compute + state.comm, state.used, np.array(need),
                                   state.capacity, len(costs), allowed)
        for ranks in sets:
            room = min(state.capacity - int(state.used[d]) - n for d, n in zip(ranks, need))
            fits.append((room, Placement(table.name, kind, tuple(ranks), tuple(costs), widths)))
    return [p for _, p in sorted(fits, key=lambda f: f[0])]


def _candidate_sets(kind, device_sets, load, used, need, capacity, shards, allowed):
    """Device tuples for one proposal that have room: table-wise the least-loaded fitting device,
    column-wise the k least-loaded fitting ones, the others their fixed sets if all fit."""
    if kind == COLUMN_WISE:
        pool = np.array([d for d in allowed if used[d] + need[0] <= capacity])
        if len(pool) < shards:
            return []
        return [tuple(int(d) for d in pool[np.argsort(load[pool], kind="stable")[:shards]])]
    fitting = [ranks for ranks in device_sets if all(used[d] + need[i] <= capacity for i, d in enumerate(ranks))]
    if kind == TABLE_WISE and fitting:
        return [min(fitting, key=lambda r: load[r[0]])]
    return fitting


def _baseline_over(state: _Loads, topology: Topology, batch_size: int) -> str:
    """Every device's share of the batch's embedding outputs (``device_baseline``) leaves no
    room for any table: the cause is the batch size, not the tables."""
    base = int(state.used.min())
    local = batch_size / topology.chips
    full = int(batch_size * state.capacity / base)  # the baseline grows with the batch
    return (f"no plan fits: at batch size {batch_size:,} each device receives {local:,.0f} samples' pooled "
            f"embedding rows of every table and their gradients, {base / 2**30:.2f} GiB before any table is placed, "
            f"more than the {state.capacity / 2**30:.2f} GiB usable per device. To make it fit: a smaller "
            f"--batch-size (well below {full:,}, where these buffers alone fill a device), more chips, or more "
            f"HBM per chip.")


def _infeasible(failed, options, capacity, used, constraints: Mapping[str, Constraint], chips: int) -> str:
    lines = []
    for t in failed:
        kind, _, costs, _ = min(options[t.name], key=lambda p: max(s.hbm_bytes for s in p[2]))
        each = max(s.hbm_bytes for s in costs)
        room = int((capacity - used >= each).sum())
        lines.append(f"table {t.name!r} ({t.num_embeddings:,} x {t.embedding_dim}, {t.optimizer}) needs "
                     f"{each / 2**30:.2f} GiB on each of {len(costs)} device(s) in its smallest allowed split "
                     f"({kind}); {room} device(s) have that much free (the most free: "
                     f"{max(0, capacity - int(used.min())) / 2**30:.2f} GiB of {capacity / 2**30:.2f} GiB usable)")
    total = sum(min(sum(s.hbm_bytes for s in p[2]) for p in options[t.name]) for t in failed)
    free = int(np.maximum(capacity - used, 0).sum())
    more = max(1, -(-int(total - free) // capacity)) if total > free else 0
    # Suggest only the splits some failing table was not allowed (those allowed were tried), and
    # only where there are devices to split over.
    allowed = {k for t in failed for k in constraints.get(t.name, Constraint()).sharding_types}
    missing = [k for k in (ROW_WISE, COLUMN_WISE) if chips > 1 and k not in allowed]
    split = f"allow {' or '.join(missing)} for these tables" if missing else ""
    if more:
        hint = ", ".join(filter(None, [f"add chips (about {more} more of this size)", split,
                                       "or reduce their embedding_dim or data_type"]))
    else:
        hint = (f"{split} so they spread over the devices with room" if split else
                "add chips or HBM per chip (the free memory is split over devices too small for these "
                "tables' shards), or reduce their embedding_dim or data_type")
    return "no plan fits: " + "; ".join(lines) + f". To make it fit: {hint}."


def plan(module, topology: Topology, batch_size: int, *, pooling_factors: Mapping[str, float] | None = None,
         constraints: Mapping[str, Constraint] | None = None, model: CostModel = CostModel()) -> PlanResult:
    """``plan_tables`` for the tables of a SparseCore collection (``tables_of``)."""
    from sparsecore.planner.specs import tables_of

    return plan_tables(tables_of(module, dict(pooling_factors or {})), topology, batch_size,
                       constraints=constraints, model=model)
