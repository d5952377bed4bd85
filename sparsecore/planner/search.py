"""The search: a sharding type and devices per table, minimizing the slowest device's step time
under every device's HBM.

Tables go largest cost first; each takes the proposal — table-wise on one
device, column-wise over k devices, row-wise over all devices or one host's
(table-row-wise), data-parallel everywhere — that leaves the slowest device
fastest (then the one adding the least time, then the least memory), among
those that fit. The lower bound is the larger of the total work spread evenly
and the cheapest per-device cost of the costliest table; the plan reports its
gap to it.
"""

from __future__ import annotations

import dataclasses
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
from sparsecore.planner.cost import ID_BYTES, CostModel, ShardCost, distinct_ids, shard_cost
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


@dataclasses.dataclass(frozen=True)
class Placement:
    table: str
    sharding_type: str
    ranks: tuple[int, ...]
    costs: tuple[ShardCost, ...]
    column_widths: tuple[int, ...] | None = None


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
    ids = batch * table.pooling_factor
    remote = (topology.chips - 1) / topology.chips

    def cost(rows: int, width: int, shard_ids: float, out_rows: float, remote_share: float = remote) -> ShardCost:
        return shard_cost(table, rows=rows, width=width, ids=shard_ids, out_rows=out_rows, remote_share=remote_share,
                          batch_ids_for_state=ids, topology=topology, model=model)

    out = []
    if TABLE_WISE in allowed:
        out.append((TABLE_WISE, [(d,) for d in devices], [cost(table.num_embeddings, table.embedding_dim, ids, batch)],
                    None))
    if COLUMN_WISE in allowed:
        k = 2
        while k <= n and table.embedding_dim % k == 0 and table.embedding_dim // k >= MIN_COLUMN_WIDTH:
            width = table.embedding_dim // k
            out.append((COLUMN_WISE, [], [cost(table.num_embeddings, width, ids, batch)] * k, (width,) * k))
            k *= 2
    if ROW_WISE in allowed and n > 1:
        rows = -(-table.num_embeddings // n)
        out.append((ROW_WISE, [tuple(devices)], [cost(rows, table.embedding_dim, ids / n, batch)] * n, None))
    if TABLE_ROW_WISE in allowed and len(topology.hosts) > 1:
        size = len(topology.hosts[0])  # a last, smaller host (chips not a multiple) is left out
        hosts = [h for h in topology.hosts if len(h) == size and set(h) <= set(devices)]
        if hosts:
            rows = -(-table.num_embeddings // size)
            out.append((TABLE_ROW_WISE, hosts, [cost(rows, table.embedding_dim, ids / size, batch)] * size, None))
    if DATA_PARALLEL in allowed and n == topology.chips:
        # A replica looks up its own samples, then updates every row the global batch touched,
        # with the row gradients (and ids) every other replica sends it.
        local = cost(table.num_embeddings, table.embedding_dim, ids / n, batch / n, remote_share=0.0)
        every_row = cost(table.num_embeddings, table.embedding_dim, ids, 0, remote_share=0.0)
        distinct = distinct_ids(ids, table.num_embeddings, table.zipf_alpha)
        gradients = remote * distinct * (ID_BYTES + table.embedding_dim * 4)
        exchange_s = gradients / (topology.ici_gbps * 1e9 * model.ici_efficiency)
        out.append((DATA_PARALLEL, [tuple(devices)],
                    [ShardCost(local.hbm_bytes, local.compute_s + every_row.compute_s, exchange_s)] * n, None))
    return out


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
    capacity = int(topology.hbm_bytes * (1 - model.reserved_fraction))
    used = np.zeros(chips, dtype=np.int64)
    compute = np.zeros(chips)
    comm = np.zeros(chips)
    options = {}
    for t in tables:
        c = constraints.get(t.name, Constraint())
        devices = c.ranks if c.ranks is not None else tuple(range(chips))
        if any(not 0 <= d < chips for d in devices):
            raise PlanningError(f"table {t.name!r}: constraint ranks {list(devices)} outside the {chips} chips")
        options[t.name] = _proposals(t, topology, batch_size, model, c.sharding_types, devices)
        if not options[t.name]:
            raise PlanningError(f"table {t.name!r}: none of its allowed sharding types {list(c.sharding_types)} "
                                f"applies on {len(devices)} device(s)")
    # Lower bound: the cheapest total work spread evenly, and the costliest table's cheapest per-device part.
    cheapest = {t.name: min(sum(s.step_s for s in p[2]) for p in options[t.name]) for t in tables}
    cheapest_part = max(min(max(s.step_s for s in p[2]) for p in options[t.name]) for t in tables)
    lower_bound = max(sum(cheapest.values()) / chips, cheapest_part)
    order = sorted(tables, key=lambda t: -cheapest[t.name])
    remaining = sum(cheapest.values())  # the least work the tables not placed yet will add
    placements, failed = [], []
    for t in order:
        remaining -= cheapest[t.name]
        best = None
        for kind, device_sets, costs, widths in options[t.name]:
            need = np.array([s.hbm_bytes for s in costs])
            step = np.array([s.step_s for s in costs])
            for ranks in _candidate_sets(kind, device_sets, compute + comm, used, need, capacity, len(costs),
                                         constraints.get(t.name, Constraint()).ranks or tuple(range(chips))):
                index = np.array(ranks)
                after = (compute + comm).copy()
                after[index] += step
                # The slowest device now, or the average once the rest is placed at its cheapest:
                # spreading a table over every device (data_parallel) must pay for all it adds.
                projected = max(float(after.max()), (float(after.sum()) + remaining) / chips)
                score = (projected, float(step.sum()), int(need.sum()))
                if best is None or score < best[0]:
                    best = (score, kind, ranks, costs, widths)
        if best is None:
            failed.append(t)
            continue
        _, kind, ranks, costs, widths = best
        index = np.array(ranks)
        used[index] += [s.hbm_bytes for s in costs]
        compute[index] += [s.compute_s for s in costs]
        comm[index] += [s.comm_s for s in costs]
        placements.append(Placement(t.name, kind, tuple(ranks), tuple(costs), widths))
    if failed:
        raise PlanningError(_infeasible(failed, options, capacity, used))
    by_name = {p.table: p for p in placements}
    plan = ShardingPlan(world_size=chips, chip=topology.chip, sparsecores_per_chip=topology.sparsecores_per_chip,
                        hosts=topology.hosts if len(topology.hosts) > 1 else None,
                        tables={t.name: TableSharding(sharding_type=by_name[t.name].sharding_type,
                                                      ranks=by_name[t.name].ranks,
                                                      column_widths=by_name[t.name].column_widths)
                                for t in tables})
    return PlanResult(plan=plan, placements=[by_name[t.name] for t in tables], device_bytes=used,
                      device_compute_s=compute, device_comm_s=comm, capacity_bytes=capacity,
                      lower_bound_s=lower_bound, planning_s=time.perf_counter() - started)


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


def _infeasible(failed, options, capacity, used) -> str:
    lines = []
    for t in failed:
        kind, _, costs, _ = min(options[t.name], key=lambda p: max(s.hbm_bytes for s in p[2]))
        each = max(s.hbm_bytes for s in costs)
        room = int((capacity - used >= each).sum())
        lines.append(f"table {t.name!r} ({t.num_embeddings:,} x {t.embedding_dim}, {t.optimizer}) needs "
                     f"{each / 2**30:.2f} GiB on each of {len(costs)} device(s) in its smallest allowed split "
                     f"({kind}); {room} device(s) have that much free (the most free: "
                     f"{(capacity - used.min()) / 2**30:.2f} GiB of {capacity / 2**30:.2f} GiB usable)")
    total = sum(min(sum(s.hbm_bytes for s in p[2]) for p in options[t.name]) for t in failed)
    free = int((capacity - used).sum())
    more = max(1, -(-int(total - free) // capacity)) if total > free else 0
    hint = (f"add chips (about {more} more of this size), allow row_wise for these tables, or reduce their "
            f"embedding_dim or data_type" if more else
            "allow row_wise (or column_wise) for these tables so they spread over the devices with room")
    return "no plan fits: " + "; ".join(lines) + f". To make it fit: {hint}."


def plan(module, topology: Topology, batch_size: int, *, pooling_factors: Mapping[str, float] | None = None,
         constraints: Mapping[str, Constraint] | None = None, model: CostModel = CostModel()) -> PlanResult:
    """``plan_tables`` for the tables of a SparseCore collection (``tables_of``)."""
    from sparsecore.planner.specs import tables_of

    return plan_tables(tables_of(module, dict(pooling_factors or {})), topology, batch_size,
                       constraints=constraints, model=model)
