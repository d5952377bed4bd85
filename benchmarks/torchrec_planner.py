"""TorchRec's own planner on our table lists, its plan in our format: the baseline ``sparsecore-plan`` is
compared against (plan quality, priced by our cost model, and planning time).

``plan_with_torchrec(tables, topology, batch_size)`` runs
``torchrec.distributed.planner.EmbeddingShardingPlanner.plan`` in this process (no process group)
with TorchRec's default enumerator, proposers, partitioner, storage reservation and cost model, and
returns ``(ShardingPlan, planning seconds)``.

What TorchRec (1.8) does here, as read in its source and seen on runs:

* Sharding types on ``compute_device="cpu"``: ``EmbeddingBagCollectionSharder.sharding_types``
  offers only data_parallel, table_wise, column_wise and table_column_wise. Row-wise,
  table_row_wise and grid_shard are "cuda" only (and "mtia", which drops data_parallel), so
  the claim holds: no row-wise on CPU. A table too big for one device can only be split by
  columns, in slices of ``min_partition`` (default 128) columns: a dim-128 table cannot be split
  at all. On the criteo-kaggle preset (26 tables, dim 128) at world size 2 every table is
  table_wise; on ``benchmarks.planner.random_tables(100)`` onto v5p:256 every table is column_wise,
  mostly a single slice on one rank (a table-wise placement TorchRec labels column-wise).
* Column-wise slices of one table may share a rank, interleaved: a dim-1024 table on 2 ranks
  becomes 8 slices of 128 on ranks 0, 1, 0, 1, ... (seen). Our format expresses that as it is
  (column_wise ranks may repeat, one width each, in column order), so we keep it; we only merge
  runs of neighbouring slices on the same rank, which is the same placement with fewer pieces.
  Merging interleaved slices per rank would reorder the columns, which a plan cannot say. Note that
  ``ShardedSparseCoreCollection`` refuses repeated column-wise ranks with row-wise Adagrad, so such
  a plan validates (and can be priced) but does not run with that optimizer.
* Tables that do not fit: ``plan()`` raises ``torchrec.distributed.planner.types.PlannerError``
  with ``error_type`` ``PlannerErrorType.INSUFFICIENT_STORAGE`` ("Unable to find a plan for this
  model because of insufficient storage", also when the total fits but one unsplittable table fits
  no device). We let it propagate.

How our inputs map onto TorchRec's:

* ``topology.hbm_bytes`` is each device's capacity. On "cpu" TorchRec gives devices no HBM at all
  (it ignores ``hbm_cap``) and keeps tables in DDR, so there the same bytes are the DDR cap too,
  else the limit would not bind. TorchRec reserves 15% of it (HeuristicalStorageReservation).
* ``batch_size`` is the global batch, as for ``plan_tables``; TorchRec's is per rank, so it gets
  ``ceil(batch_size / chips)``.
* Optimizer state: TorchRec's storage estimate counts it only for an optimizer attached to the
  weight (``_apply_optimizer_in_backward``), not from the sharder's fused params, so we attach
  both. fbgemm has no FTRL: an FTRL table is planned as Adam, which keeps the same state (two
  values per element), the only thing the planner reads from the optimizer.
* Not passed: ``zipf_alpha`` (TorchRec's cost model has no id skew) and our chip's bandwidths
  (TorchRec keeps its own defaults).
* Conversion: table_wise and column_wise keep their type; table_column_wise (column slices on one
  host's ranks) becomes our column_wise with the same slices on the same ranks, since our format
  has no such type; row_wise keeps every rank in shard order (TorchRec's contiguous row blocks
  become our mod-sharded rows); table_row_wise keeps its host's ranks; data_parallel takes every
  rank. Anything else (grid_shard, partial-row column slices) raises ValueError.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence

import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig
from torchrec import optim as trec_optim
from torchrec.distributed import logger as torchrec_logger
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner import Topology as TorchRecTopology
from torchrec.distributed.types import ParameterSharding

from sparsecore.distributed.plan import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    ShardingPlan,
    TableSharding,
)
from sparsecore.planner.specs import TableSpec
from sparsecore.planner.topology import Topology

TABLE_COLUMN_WISE = "table_column_wise"
"""TorchRec's column slices on one host's ranks; ours has no such type (see the module docstring)."""

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], EmbOptimType]] = {
    "sgd": (trec_optim.SGD, EmbOptimType.EXACT_SGD),
    "adagrad": (trec_optim.Adagrad, EmbOptimType.EXACT_ADAGRAD),
    "rowwise_adagrad": (trec_optim.RowWiseAdagrad, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    "adam": (trec_optim.Adam, EmbOptimType.ADAM),
    "ftrl": (trec_optim.Adam, EmbOptimType.ADAM),  # no FTRL in fbgemm; Adam holds the same state bytes
}
"""Our optimizer name -> (the class TorchRec's storage estimate reads, the fused kernel's type)."""

DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}

LEARNING_RATE = 0.01
"""Any rate: planning reads only the optimizer's kind, but its constructor wants one."""


def plan_with_torchrec(tables: Sequence[TableSpec], topology: Topology, batch_size: int) -> tuple[ShardingPlan, float]:
    """TorchRec's EmbeddingShardingPlanner on these tables (its own cost model, storage limits
    from topology.hbm_bytes per rank, world size topology.chips, local_world_size
    topology.chips_per_host); returns its plan converted to ours and the planning seconds."""
    if not tables:
        raise ValueError("no tables to plan")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r}; expected a positive integer (the global batch)")
    module = _meta_collection(tables)
    with _quiet_torchrec():
        planner = EmbeddingShardingPlanner(
            topology=_torchrec_topology(topology),
            batch_size=math.ceil(batch_size / topology.chips),
            constraints={t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in tables})
        sharder = EmbeddingBagCollectionSharder(fused_params=_fused_params(tables))
        started = time.perf_counter()
        torchrec_plan = planner.plan(module, [sharder])
        seconds = time.perf_counter() - started
    shardings = {name: sharding for module_plan in torchrec_plan.plan.values()
                 for name, sharding in module_plan.items()}
    return _to_our_plan(tables, topology, shardings), seconds


def _meta_collection(tables: Sequence[TableSpec]) -> EmbeddingBagCollection:
    """The tables as an EmbeddingBagCollection on the meta device (no memory), each weight
    carrying its optimizer so that TorchRec's storage estimate counts the optimizer state."""
    configs = [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                  feature_names=[t.name], data_type=DATA_TYPES[t.data_type]) for t in tables]
    module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    for t in tables:
        optimizer_class, _ = OPTIMIZERS[t.optimizer]
        weight = module.embedding_bags[t.name].weight
        _apply_optimizer_in_backward(optimizer_class, [weight], {"lr": LEARNING_RATE})
    return module


def _fused_params(tables: Sequence[TableSpec]) -> dict[str, object]:
    """The sharder's fused kernel options: the tables' optimizer when they share one. With a mix,
    TorchRec's sharder takes each table's own from the optimizer attached to its weight."""
    kinds = {OPTIMIZERS[t.optimizer][1] for t in tables}
    params: dict[str, object] = {"learning_rate": LEARNING_RATE}
    if len(kinds) == 1:
        params["optimizer"] = kinds.pop()
    return params


def _torchrec_topology(topology: Topology) -> TorchRecTopology:
    # On "cpu" TorchRec gives devices no HBM and keeps tables in DDR: the chip's HBM must be the
    # DDR cap for the limit to bind. Our hosts are chips_per_host ranks each, never more than the world.
    return TorchRecTopology(world_size=topology.chips, compute_device="cpu", hbm_cap=topology.hbm_bytes,
                            ddr_cap=topology.hbm_bytes, local_world_size=min(topology.chips_per_host, topology.chips))


class _FromTorchRec(logging.Filter):
    """Drops records logged from TorchRec's files: some go straight to the root logger
    (``logging.warning("Sharding spec not found ...")`` for every data_parallel table)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(TORCHREC_DIR)


TORCHREC_DIR = os.path.dirname(torchrec.__file__) + os.sep


@contextlib.contextmanager
def _quiet_torchrec() -> Iterator[None]:
    """TorchRec's planner logs a stats table and warnings (topology not built by its factory,
    storage reservation heuristics, data_parallel tables without a shard list) on every call:
    muted here, and restored after."""
    names = ["torchrec"] + [n for n in logging.root.manager.loggerDict if n.startswith("torchrec.")]
    # Also its method-call telemetry: unseen (a NullHandler, no propagation) unless someone attaches
    # a handler, as pytest's caplog does to every non-propagating logger.
    loggers = [logging.getLogger(n) for n in names] + [
        lg for lg in vars(torchrec_logger).values() if isinstance(lg, logging.Logger)]
    before = [(lg.disabled, lg.level) for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    # Loggers created during the call have no level of their own: the parent's stops them.
    loggers[0].setLevel(logging.CRITICAL + 1)
    root_filter = _FromTorchRec()
    logging.root.addFilter(root_filter)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.root.removeFilter(root_filter)
        for lg, (disabled, level) in zip(loggers, before):
            lg.disabled = disabled
            lg.setLevel(level)


def _to_our_plan(tables: Sequence[TableSpec], topology: Topology,
                 shardings: dict[str, ParameterSharding]) -> ShardingPlan:
    missing = sorted({t.name for t in tables} - set(shardings))
    if missing:
        raise ValueError(f"TorchRec's plan has no sharding for table(s) {missing}")
    return ShardingPlan(world_size=topology.chips, chip=topology.chip,
                        sparsecores_per_chip=topology.sparsecores_per_chip,
                        hosts=topology.hosts if len(topology.hosts) > 1 else None,
                        tables={t.name: _to_table_sharding(t, topology, shardings[t.name]) for t in tables})


def _to_table_sharding(table: TableSpec, topology: Topology, sharding: ParameterSharding) -> TableSharding:
    kind = sharding.sharding_type
    if kind == DATA_PARALLEL:
        return TableSharding(sharding_type=DATA_PARALLEL, ranks=tuple(range(topology.chips)))
    shards = _shards(table, sharding)
    if kind == TABLE_WISE:
        if len(shards) != 1:
            raise ValueError(f"table {table.name!r}: TorchRec made {len(shards)} table_wise shards; expected one")
        return TableSharding(sharding_type=TABLE_WISE, ranks=(shards[0][0],))
    if kind in (COLUMN_WISE, TABLE_COLUMN_WISE):
        return _column_wise(table, kind, shards)
    if kind == ROW_WISE:
        return TableSharding(sharding_type=ROW_WISE, ranks=_row_ranks(table, kind, shards))
    if kind == TABLE_ROW_WISE:
        ranks = _row_ranks(table, kind, shards)
        host = next((h for h in topology.hosts if set(ranks) == set(h)), None)
        if host is None:
            raise ValueError(f"table {table.name!r}: TorchRec put table_row_wise shards on ranks {list(ranks)}; ours "
                             f"must be exactly one host's ranks, one of {[list(h) for h in topology.hosts]}")
        return TableSharding(sharding_type=TABLE_ROW_WISE, ranks=ranks)
    raise ValueError(f"table {table.name!r}: TorchRec chose sharding type {kind!r}, which our plan format cannot "
                     f"express; expected one of table_wise, column_wise, table_column_wise, row_wise, "
                     f"table_row_wise, data_parallel")


Shard = tuple[int, int, int, int, int]
"""(rank, first row, rows, first column, columns) of one TorchRec shard."""


def _shards(table: TableSpec, sharding: ParameterSharding) -> list[Shard]:
    if sharding.sharding_spec is None:
        raise ValueError(f"table {table.name!r}: TorchRec's {sharding.sharding_type} sharding has no shard list")
    out = []
    for s in sharding.sharding_spec.shards:
        rank = s.placement.rank() if s.placement is not None else None
        if rank is None:
            raise ValueError(f"table {table.name!r}: a TorchRec shard has no rank ({s})")
        (row, col), (rows, cols) = s.shard_offsets, s.shard_sizes
        out.append((rank, row, rows, col, cols))
    return out


def _column_wise(table: TableSpec, kind: str, shards: list[Shard]) -> TableSharding:
    """Column slices in column order; neighbouring slices on one rank merged (same placement)."""
    ranks: list[int] = []
    widths: list[int] = []
    expected_col = 0
    for rank, row, rows, col, cols in sorted(shards, key=lambda s: s[3]):
        if row != 0 or rows != table.num_embeddings or col != expected_col:
            raise ValueError(f"table {table.name!r}: TorchRec's {kind} shards are not whole-row column slices "
                             f"side by side ({[s[1:] for s in shards]} as (row, rows, column, columns)); our "
                             f"column_wise has only whole-row slices covering the dim in order")
        if ranks and ranks[-1] == rank:
            widths[-1] += cols
        else:
            ranks.append(rank)
            widths.append(cols)
        expected_col = col + cols
    if expected_col != table.embedding_dim:
        raise ValueError(f"table {table.name!r}: TorchRec's {kind} slices cover {expected_col} of the dim "
                         f"{table.embedding_dim}")
    return TableSharding(sharding_type=COLUMN_WISE, ranks=tuple(ranks), column_widths=tuple(widths))


def _row_ranks(table: TableSpec, kind: str, shards: list[Shard]) -> tuple[int, ...]:
    """The ranks of whole-width row blocks, in row order, each once."""
    ordered = sorted(shards, key=lambda s: s[1])
    ranks = tuple(s[0] for s in ordered)
    if any(s[3] != 0 or s[4] != table.embedding_dim for s in ordered) or len(set(ranks)) != len(ranks):
        raise ValueError(f"table {table.name!r}: TorchRec's {kind} shards {[s for s in ordered]} (rank, row, rows, "
                         f"column, columns) are not whole-width row blocks one per rank, which our {kind} needs")
    return ranks
