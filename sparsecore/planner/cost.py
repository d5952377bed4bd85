"""What a shard costs a device: HBM bytes and step time.

A shard's ``Work`` in a step is counted from its table and sharding type
(``shard_costs``): the bytes its lookup and update move through HBM
(distinct ids only: an id's row is read once, and updated once), the ids it
looks up, the shard itself (a launch), the ids it routes to their owner
SparseCore (row-wise), the row gradients it gathers from other replicas
(data-parallel) or whose squares it sums with the other column shards
(row-wise Adagrad), the bytes and collectives it exchanges. Time is that
work at the ``CostModel``'s rates (fitted by planner/fit.py). Storage: the
shard's rows (weights, fp32 optimizer state), its COO buffers for a step's
ids (12 bytes an id), its output rows (fp32, forward and gradient) and what
its exchanges hold for a moment.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from sparsecore.distributed.plan import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    SHARDING_TYPES,
    TABLE_ROW_WISE,
    TABLE_WISE,
)
from sparsecore.planner.specs import TableSpec
from sparsecore.planner.topology import Topology

ID_BYTES = 8
COO_BYTES_PER_ID = 12  # local row, bag, gain
EXCHANGES_PER_STEP = 3  # ids in, rows out, their gradients back


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """The cost model's constants. The defaults are priors for a real TPU (no TPU here to fit
    them on); ``fit_cost_model`` replaces them with what measured runs show."""

    hbm_efficiency: float = 0.5
    """Share of peak HBM bandwidth a lookup or update reaches (gathers of short rows)."""
    ici_efficiency: float = 0.7
    """Share of peak ICI bandwidth an all_to_all reaches."""
    id_s: float = 0.0
    """Seconds per id a device looks up, beyond its bytes (preprocessing, routing)."""
    shard_s: float = 0.0
    """Seconds per shard a device holds, per step (launching its lookup and update)."""
    exchange_s: float = 0.0
    """Seconds of latency per collective a device takes part in."""
    route_id_s: float = 0.0
    """Seconds per id a device routes to its owner SparseCore (row-wise sharding)..."""
    route_table_s: float = 0.0
    """... and per row-wise table it routes the ids of."""
    gather_row_s: float = 0.0
    """Seconds per row gradient a replica gathers from the others and sums (data_parallel)."""
    row_statistic_s: float = 0.0
    """Seconds per row whose squared gradient column shards sum (column_wise, row-wise Adagrad)."""
    reserved_fraction: float = 0.1
    """HBM kept free (dense arch, activations, fragmentation)."""
    fitted_from: str = ""
    """What the constants were fitted to (empty: the priors)."""

    def __post_init__(self) -> None:
        for field in ("hbm_efficiency", "ici_efficiency"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"cost model {field}={value!r}; expected a positive number")
        for field in (f.name for f in dataclasses.fields(self) if f.name.endswith("_s")):  # the per-unit times
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"cost model {field}={value!r}; expected a non-negative number of seconds")
        if not 0 <= self.reserved_fraction < 1:
            raise ValueError(f"cost model reserved_fraction={self.reserved_fraction!r}; expected 0 <= it < 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cost model: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**data)


def read_cost_model(path: str | Path) -> CostModel:
    """A cost model JSON written by ``CostModel.to_dict`` (e.g. by benchmarks/planner_calibration.py)."""
    path = Path(path)
    try:
        return CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{path}: not a cost model ({error})") from error


@functools.lru_cache(maxsize=4)
def _zipf_misses(rows: int, zipf_alpha: float) -> tuple[np.ndarray, float, int]:
    """Per ranked row of a Zipf(alpha) table, log(1 - p) of a draw missing it; the tail's
    share of the draws; the rows counted one by one. A table is asked for two draw counts
    in a row (the batch's and a replica's): the million-row vector is built once."""
    head = min(rows, 1_000_000)  # the tail beyond is rarely drawn: counted as its expectation
    ranks = np.arange(1, head + 1, dtype=np.float64)
    weights = ranks ** -zipf_alpha
    tail = 0.0
    if rows > head:  # integral of x^-alpha from head to rows
        tail = (math.log(rows / head) if zipf_alpha == 1 else
                (rows ** (1 - zipf_alpha) - head ** (1 - zipf_alpha)) / (1 - zipf_alpha))
    total = weights.sum() + tail
    p = weights / total
    return np.log1p(-np.minimum(p, 1 - 1e-12)), tail / total, head


@functools.lru_cache(maxsize=4096)
def distinct_ids(draws: float, rows: int, zipf_alpha: float | None) -> float:
    """Expected distinct ids among ``draws`` ids of ``rows`` (uniform, or Zipf(alpha) by rank)."""
    if draws <= 0:
        return 0.0
    if zipf_alpha is None:
        return rows * -math.expm1(draws * math.log1p(-1.0 / rows)) if rows > 1 else 1.0
    log_miss, tail_share, head = _zipf_misses(rows, zipf_alpha)
    return float((-np.expm1(draws * log_miss)).sum() + min(tail_share * draws, rows - head))


@dataclasses.dataclass(frozen=True)
class Work:
    """What a shard does in a step, before any constant: the model's features."""

    hbm_bytes: float = 0.0
    """Bytes moved through HBM: distinct rows read (lookup) and read and written with their
    optimizer state (update), COO entries, output rows and their gradients."""
    ids: float = 0.0
    """Ids looked up."""
    shards: float = 0.0
    """Shards launched (each a lookup and an update)."""
    routed_ids: float = 0.0
    """Ids sent one by one to the SparseCore that owns their row (row-wise sharding)."""
    routed_tables: float = 0.0
    """Row-wise tables whose ids are routed so."""
    gathered_rows: float = 0.0
    """Row gradients a replica gathers from every replica and sums before its update."""
    row_statistics: float = 0.0
    """Rows whose squared gradient column shards sum before their update (row-wise Adagrad)."""
    exchanged_bytes: float = 0.0
    """Bytes sent to other devices (ids, output rows, gradients)."""
    exchanges: float = 0.0
    """Collectives of its own (beyond the step's ids-in, rows-out, gradients-back)."""

    def __add__(self, other: Work) -> Work:
        # Not dataclasses.astuple: it deep-copies, and plans add up thousands of these.
        return Work(*(getattr(self, f) + getattr(other, f) for f in _WORK_FIELDS))


_WORK_FIELDS = tuple(f.name for f in dataclasses.fields(Work))
COMPUTE_FEATURES = ("hbm_bytes", "ids", "shards", "routed_ids", "routed_tables", "gathered_rows", "row_statistics")


@dataclasses.dataclass(frozen=True)
class ShardCost:
    hbm_bytes: int
    compute_s: float
    comm_s: float
    work: Work = Work()

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


def compute_rates(topology: Topology, model: CostModel) -> tuple[float, ...]:
    """Seconds per unit of each of COMPUTE_FEATURES."""
    return (1.0 / (topology.hbm_gbps * 1e9 * model.hbm_efficiency), model.id_s, model.shard_s, model.route_id_s,
            model.route_table_s, model.gather_row_s, model.row_statistic_s)


def compute_seconds(work: Work, topology: Topology, model: CostModel) -> float:
    return sum(getattr(work, f) * rate for f, rate in zip(COMPUTE_FEATURES, compute_rates(topology, model)))


def comm_seconds(work: Work, topology: Topology, model: CostModel) -> float:
    return work.exchanged_bytes / (topology.ici_gbps * 1e9 * model.ici_efficiency) + work.exchanges * model.exchange_s


def priced(hbm_bytes: float, work: Work, topology: Topology, model: CostModel) -> ShardCost:
    return ShardCost(hbm_bytes=int(hbm_bytes), compute_s=compute_seconds(work, topology, model),
                     comm_s=comm_seconds(work, topology, model), work=work)


def lookup_work(table: TableSpec, *, width: int, ids: float, out_rows: float, remote_share: float,
                batch_ids: float, rows: int, training: bool = True) -> Work:
    """One shard's lookup (and fused update): ``ids`` of the batch's ``batch_ids`` ids of
    ``table`` (which are distinct follows the table's id distribution), at most ``rows`` rows of
    ``width``, ``out_rows`` output rows; ``remote_share`` of its ids and rows cross to other devices."""
    distinct = touched_rows(table, ids, batch_ids, rows)
    moved = distinct * width * table.element_bytes + ids * COO_BYTES_PER_ID + out_rows * width * 4
    if training:
        moved += 2 * distinct * row_bytes(table, width) + out_rows * width * 4
    exchanged = remote_share * (ids * ID_BYTES + (2 if training else 1) * out_rows * width * 4)
    return Work(hbm_bytes=moved, ids=ids, shards=1, exchanged_bytes=exchanged)


def touched_rows(table: TableSpec, ids: float, batch_ids: float, rows: float) -> float:
    """Distinct rows among ``ids`` of the batch's ``batch_ids`` ids of ``table``, at most ``rows``."""
    return min(distinct_ids(batch_ids, table.num_embeddings, table.zipf_alpha) * ids / max(batch_ids, 1e-9), rows)


def row_bytes(table: TableSpec, width: int) -> int:
    """A row's weights (``width`` of them) and its fp32 optimizer state."""
    return width * table.element_bytes + table.state_values(width) * 4


def storage_bytes(table: TableSpec, rows: int, width: int) -> int:
    """A shard's weights and fp32 optimizer state."""
    return rows * row_bytes(table, width)


def buffer_bytes(ids: float, out_rows: float, width: int) -> float:
    """A step's COO entries and fp32 output rows with their gradients."""
    return ids * COO_BYTES_PER_ID + 2 * out_rows * width * 4


def shard_costs(table: TableSpec, kind: str, shards: int, topology: Topology, batch: int, model: CostModel,
                column_widths: tuple[int, ...] | None = None) -> list[ShardCost]:
    """Per shard, the cost of ``table`` sharded ``kind`` over ``shards`` devices (column_wise:
    one shard per width of ``column_widths``); ``batch`` is the global batch."""
    ids = batch * table.pooling_factor
    remote = (topology.chips - 1) / topology.chips
    dim, rows = table.embedding_dim, table.num_embeddings

    def lookup(rows: int, width: int, shard_ids: float, out_rows: float, remote_share: float = remote,
               training: bool = True, drawn_from: float = ids) -> Work:
        return lookup_work(table, width=width, ids=shard_ids, out_rows=out_rows, remote_share=remote_share,
                           batch_ids=drawn_from, rows=rows, training=training)

    if kind == TABLE_WISE:
        return [priced(storage_bytes(table, rows, dim) + buffer_bytes(ids, batch, dim), lookup(rows, dim, ids, batch),
                       topology, model)]
    if kind == COLUMN_WISE:
        k = len(column_widths)
        # Row-wise Adagrad: the whole row's squared gradient is summed over the column shards
        # (the batch's row gradients come out of the fused backward, then one ring all_reduce
        # of a float per row over the k shards).
        summed = table.optimizer == "rowwise_adagrad" and k > 1
        touched = touched_rows(table, ids, ids, rows) if summed else 0.0
        statistic = Work(row_statistics=touched, exchanged_bytes=2 * (k - 1) / k * touched * 4, exchanges=1)
        out = []
        for width in column_widths:
            work, transient = lookup(rows, width, ids, batch), 0.0
            if summed:
                work, transient = work + statistic, ids * (width * 4 + ID_BYTES)
            out.append(priced(storage_bytes(table, rows, width) + buffer_bytes(ids, batch, width) + transient, work,
                              topology, model))
        return out
    if kind in (ROW_WISE, TABLE_ROW_WISE):
        part = -(-rows // shards)
        # Each shard makes partial sums for the whole batch; a device joins those of its samples
        # from every shard, and in the backward splits its gradient into a block per shard and
        # joins the blocks it receives: three passes over batch x dim, two buffers of it.
        join = batch * dim * 4
        work = lookup(part, dim, ids / shards, batch) + Work(hbm_bytes=3 * join, routed_ids=ids / shards,
                                                             routed_tables=1)
        hbm = storage_bytes(table, part, dim) + buffer_bytes(ids / shards, batch, dim) + 2 * join
        return [priced(hbm, work, topology, model)] * shards
    if kind == DATA_PARALLEL:
        # A replica looks up its own samples, gathers every replica's row gradients (and
        # ids), sums them per row and updates every row the global batch touched.
        local_ids, local_batch = ids / shards, batch / shards
        # Distinct among the replica's own ids (a smaller draw repeats less than its share of the batch's).
        local_rows = touched_rows(table, local_ids, local_ids, rows)
        every_row = touched_rows(table, ids, ids, rows)
        gradient_bytes = dim * 4 + ID_BYTES  # a row's gradient and its id
        work = lookup(rows, dim, local_ids, local_batch, remote_share=0.0, training=False,
                      drawn_from=local_ids) + Work(
            hbm_bytes=local_batch * dim * 4 + 2 * every_row * row_bytes(table, dim),
            gathered_rows=shards * local_rows, exchanged_bytes=remote * shards * local_rows * gradient_bytes,
            exchanges=4)  # an all_gather of the sizes, then of the data, for the rows and for their gradients
        # The rows' gradients, every replica's gathered (and joined), their sums. Its output rows
        # are the device's own samples': device_baseline counts them.
        transient = local_ids * gradient_bytes + 2 * shards * local_rows * gradient_bytes + every_row * dim * 4
        hbm = storage_bytes(table, rows, dim) + buffer_bytes(local_ids, 0, dim) + transient
        return [priced(hbm, work, topology, model)] * shards
    raise ValueError(f"unknown sharding type {kind!r}; expected one of {list(SHARDING_TYPES)}")
