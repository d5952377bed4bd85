"""Sharding SparseCore embedding collections over a process group (``tpu_dist``).

``shard(module, plan)`` splits a module's tables (pooled or sequence) over the ranks as a
``ShardingPlan`` says (table-wise, row-wise, column-wise, table-row-wise,
data-parallel); ``default_plan`` makes one without a planner.
"""

from sparsecore.distributed.plan import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    SHARDING_TYPES,
    TABLE_ROW_WISE,
    TABLE_WISE,
    PlanError,
    ShardingPlan,
    TableSharding,
    default_plan,
)
from sparsecore.distributed.sharded import (
    LocalShard,
    ShardedSparseCoreCollection,
    ShardedSparseCoreEmbeddingBagCollection,
    shard,
)
from sparsecore.distributed.sequence import ShardedSparseCoreEmbeddingCollection

__all__ = [
    "COLUMN_WISE",
    "DATA_PARALLEL",
    "ROW_WISE",
    "SHARDING_TYPES",
    "TABLE_ROW_WISE",
    "TABLE_WISE",
    "LocalShard",
    "PlanError",
    "ShardedSparseCoreCollection",
    "ShardedSparseCoreEmbeddingBagCollection",
    "ShardedSparseCoreEmbeddingCollection",
    "ShardingPlan",
    "TableSharding",
    "default_plan",
    "shard",
]
