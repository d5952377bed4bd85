"""Where every shard of a sharded module lives, and how its rows and columns map back.

Computed from the plan alone, identically on every rank: the local tables each
rank's engine holds, the route of every feature's ids to those tables, and how
the ranks' pooled columns assemble into the module's output.

Row-wise ids (``row_wise`` over ``k`` ranks, ``table_row_wise`` over one host's)
follow the TPU's mod sharding over all ``m = k * n`` SparseCores: id ``i``
belongs to global SparseCore ``g = i % m``, i.e. to shard ``g // n``, where it
is local id ``(i // m) * n + g % n`` — which the rank's engine mod-shards over
its ``n`` SparseCores again, landing on SparseCore ``g % n``. Example, k = 2,
n = 2 (m = 4): ids 0 1 | 2 3 | 4 5 | 6 7 -> shard 0 0 | 1 1 | 0 0 | 1 1, local
ids 0 1 | 0 1 | 2 3 | 2 3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torchrec.modules.embedding_configs import PoolingType

from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.distributed.plan import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, ShardingPlan

ROW_SHARDED = (ROW_WISE, TABLE_ROW_WISE)


@dataclasses.dataclass(frozen=True)
class RowBuckets:
    """Mod sharding of a table's ids over ``shards`` ranks of ``sparsecores`` SparseCores each."""

    shards: int
    sparsecores: int

    @property
    def modulus(self) -> int:
        return self.shards * self.sparsecores

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.modulus // self.sparsecores

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids // self.modulus * self.sparsecores + ids % self.sparsecores

    def global_ids(self, local: torch.Tensor, shard: int) -> torch.Tensor:
        n = self.sparsecores
        return local // n * self.modulus + shard * n + local % n

    def local_rows(self, num_embeddings: int, shard: int) -> int:
        """Rows shard ``shard`` needs: its largest local id + 1 (0 if it owns no id)."""
        first = shard * self.sparsecores  # the shard's smallest id
        if num_embeddings <= first:
            return 0
        blocks = (num_embeddings - 1 - first) // self.modulus  # full cycles before the last id it owns
        last_in_block = min(self.sparsecores - 1, num_embeddings - 1 - first - blocks * self.modulus)
        return blocks * self.sparsecores + last_in_block + 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """One piece of a table: the rows and columns one rank holds."""

    table: str
    index: int
    """Shard number within the table, e.g. ``1``."""
    rank: int
    local_table: str
    """The table's name in the rank's engine (``"<table>"``, or ``"<table>@col<i>"`` column-wise)."""
    local_features: tuple[str, ...]
    """Per feature of the table, its name in the rank's engine."""
    column_offset: int
    width: int
    rows: RowBuckets | None
    """Row-sharded tables: the mod sharding of the ids; None: every row."""
    num_rows: int
    """Rows of the local table (at least 1: a shard that owns no id keeps one unused row)."""
    source: SparseCoreEmbeddingConfig
    stack: str | None = None
    """Column shards: the engine stack they share with the same slice of tables split the same
    way, e.g. ``"cw_r0-1_w32-32_c0"`` (peers then hold equal stacks, row for row)."""

    def global_ids(self) -> torch.Tensor:
        """The table id of each local row (ids past the table's end mark unused rows)."""
        local = torch.arange(self.num_rows)
        return local if self.rows is None else self.rows.global_ids(local, self.index)

    def local_config(self) -> SparseCoreEmbeddingConfig:
        """The engine's config of this shard. Row-sharded bags arrive partial, with their
        gains (weight x combiner scale of the whole bag) as weights: they pool by plain sum.
        Sequence bags arrive already truncated to ``max_seq_len`` (by the sending rank)."""
        changes = dict(name=self.local_table, num_embeddings=self.num_rows, embedding_dim=self.width,
                       feature_names=list(self.local_features))
        if self.rows is not None and self.source.is_pooled:
            changes["pooling"] = PoolingType.SUM
        config = dataclasses.replace(self.source.config, **changes)
        # Column shards stack only with the same slice of tables split the same way: their
        # backward may combine row statistics with the peer stacks (sparsecore.distributed.row_exchange).
        stack = self.stack if self.stack is not None else self.source.stack_table_name
        return dataclasses.replace(self.source, config=config, stack_table_name=stack, max_seq_len=None,
                                   combiner=None if self.rows is not None else self.source.combiner)


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a feature's ids go: to ``rank`` as ``local_feature``, all or (row-sharded) one shard's."""

    rank: int
    local_feature: str
    rows: RowBuckets | None
    shard: int


class ShardLayout:
    """The shards of every table of a module under a plan; the same on every rank."""

    def __init__(self, configs: Sequence[SparseCoreEmbeddingConfig], plan: ShardingPlan):
        plan.validate(configs)
        self.configs = list(configs)
        self.world_size = plan.world_size
        self.replicated = [c for c in configs if plan.tables[c.name].sharding_type == DATA_PARALLEL]
        """data_parallel tables: a whole replica on every rank, fed the rank's own samples."""
        self.shards: dict[str, list[Shard]] = {c.name: self._shards_of(c, plan) for c in configs
                                               if c not in self.replicated}
        # Each rank's engine: its column/table shards first, then row shards, in table order.
        self.local: list[list[Shard]] = [[] for _ in range(plan.world_size)]
        for shard in (s for shards in self.shards.values() for s in shards):
            self.local[shard.rank].append(shard)
        for rank in range(plan.world_size):
            self.local[rank].sort(key=lambda s: s.rows is not None)

    @staticmethod
    def _shards_of(config: SparseCoreEmbeddingConfig, plan: ShardingPlan) -> list[Shard]:
        sharding = plan.tables[config.name]
        kind, ranks = sharding.sharding_type, sharding.ranks
        compute = dict(sharding.compute)
        source = dataclasses.replace(config, **compute) if compute else config
        if kind == COLUMN_WISE:
            shards, offset = [], 0
            split = f"cw_r{'-'.join(map(str, ranks))}_w{'-'.join(map(str, sharding.column_widths))}"
            for i, (rank, width) in enumerate(zip(ranks, sharding.column_widths)):
                shards.append(Shard(table=config.name, index=i, rank=rank, local_table=f"{config.name}@col{i}",
                                    local_features=tuple(f"{f}@col{i}" for f in config.feature_names),
                                    column_offset=offset, width=width, rows=None,
                                    num_rows=config.num_embeddings, source=source,
                                    stack=f"{split}_c{i}_{str(config.dtype).removeprefix('torch.')}"))
                offset += width
            return shards
        if kind in ROW_SHARDED:
            buckets = RowBuckets(len(ranks), plan.sparsecores_per_chip)
            return [Shard(table=config.name, index=i, rank=rank, local_table=config.name,
                          local_features=tuple(config.feature_names), column_offset=0, width=config.embedding_dim,
                          rows=buckets, num_rows=max(1, buckets.local_rows(config.num_embeddings, i)),
                          source=source)
                    for i, rank in enumerate(ranks)]
        return [Shard(table=config.name, index=0, rank=ranks[0], local_table=config.name,
                      local_features=tuple(config.feature_names), column_offset=0, width=config.embedding_dim,
                      rows=None, num_rows=config.num_embeddings, source=source)]

    # ---- the input side ----

    def local_features(self, rank: int) -> list[str]:
        """The engine's features on ``rank``, in its output column order."""
        return [f for s in self.local[rank] for f in s.local_features]

    def routes(self) -> dict[str, list[Route]]:
        """Per module feature: every (rank, local feature) its ids go to."""
        out: dict[str, list[Route]] = {}
        for c in self.configs:
            if c in self.replicated:
                continue
            for j, feature in enumerate(c.feature_names):
                out[feature] = [Route(s.rank, s.local_features[j], s.rows, s.index) for s in self.shards[c.name]]
        return out

    # ---- the output side ----

    def local_width(self, rank: int) -> int:
        return sum(s.width * len(s.local_features) for s in self.local[rank])

    def output_gathers(self) -> list[torch.Tensor]:
        """Column indexes into the ranks' received blocks side by side (rank order), then the
        replicated tables' own block, then one zero column: the module's output is the sum of
        these gathers. A column of a table-wise, column-wise or replicated table has one
        source, a row-sharded one a source per shard."""
        start, column = {}, 0
        for rank in range(self.world_size):
            for s in self.local[rank]:
                for f in s.local_features:
                    start[(rank, f)] = column
                    column += s.width
        replica_start = {}
        for c in self.replicated:
            for f in c.feature_names:
                replica_start[f] = column
                column += c.embedding_dim
        zero = column
        sources: list[list[int]] = []
        for c in self.configs:
            if c in self.replicated:
                sources += [[replica_start[f] + col] for f in c.feature_names for col in range(c.embedding_dim)]
                continue
            shards = self.shards[c.name]
            for j in range(len(c.feature_names)):
                for col in range(c.embedding_dim):
                    sources.append([start[(s.rank, s.local_features[j])] + col - s.column_offset for s in shards
                                    if s.column_offset <= col < s.column_offset + s.width])
        depth = max(len(s) for s in sources)
        return [torch.tensor([s[k] if k < len(s) else zero for s in sources]) for k in range(depth)]
