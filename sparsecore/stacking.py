"""Table stacking and mod sharding: where each table's rows live on the SparseCores.

Tables of equal dim and kind share one physical table (a *stack*), so one
kernel call serves many features. Rows are mod-sharded over the SparseCores:
id ``i`` of a table with rotation ``r`` lives on SparseCore ``(i + r) % n`` as
local row ``offset + (i + r) // n``. Table ``k`` of a stack gets rotation
``k % n``, so small tables do not all pile their row 0 onto SparseCore 0.

Example: two tables of 5 and 3 rows on 2 SparseCores::

    t0 (rotation 0): ids 0..4 -> (sc, row) (0,0) (1,0) (0,1) (1,1) (0,2)   rows 0..2
    t1 (rotation 1): ids 0..2 -> (sc, row) (1,3) (0,4) (1,4)               rows 3..4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import torch

from sparsecore.config import SparseCoreEmbeddingConfig

IdsT = TypeVar("IdsT", int, torch.Tensor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TablePlacement:
    """Where one table sits in its stack."""

    rotation: int
    """Shard rotation, e.g. ``1``: id 0 lives on SparseCore ``rotation % n``."""
    row_offset: int
    """First local row of the table on every SparseCore, e.g. ``3``."""
    rows_per_sparsecore: int
    """Local rows the table takes on each SparseCore, e.g. ``2``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackSpec:
    """One physical table: the tables stacked into it and its layout."""

    name: str
    """Stack name, e.g. ``"stack_d16_pooled"``."""
    tables: tuple[SparseCoreEmbeddingConfig, ...]
    """The stacked tables, in stacking order."""
    num_sparsecores: int
    """SparseCores the rows are sharded over, e.g. ``4``."""
    placements: dict[str, TablePlacement]
    """Per table name: rotation and row range."""
    weighted: bool = True
    """Whether a KJT's weights scale its ids' rows (TorchRec's ``is_weighted``); False: they
    are ignored, as TorchRec's unweighted collections ignore them."""

    @property
    def embedding_dim(self) -> int:
        return self.tables[0].embedding_dim

    @property
    def is_pooled(self) -> bool:
        return self.tables[0].is_pooled

    @property
    def rows_per_sparsecore(self) -> int:
        return sum(p.rows_per_sparsecore for p in self.placements.values())

    @property
    def feature_names(self) -> list[str]:
        return [f for t in self.tables for f in t.feature_names]

    @property
    def coo_buffer_size_per_device(self) -> int | None:
        """The stack's tables' largest ``suggested_coo_buffer_size_per_device``, if any set one."""
        sizes = [t.suggested_coo_buffer_size_per_device for t in self.tables
                 if t.suggested_coo_buffer_size_per_device is not None]
        return max(sizes) if sizes else None

    @property
    def max_ids_per_partition(self) -> int:
        return max(t.max_ids_per_partition for t in self.tables)

    @property
    def max_unique_ids_per_partition(self) -> int:
        return max(t.max_unique_ids_per_partition for t in self.tables)

    def locate(self, table: str, ids: IdsT) -> tuple[IdsT, IdsT]:
        """(SparseCore, local row) of an id of a table, or elementwise of a tensor of ids."""
        p = self.placements[table]
        shifted = ids + p.rotation
        return shifted % self.num_sparsecores, p.row_offset + shifted // self.num_sparsecores

    @property
    def physical_rows(self) -> int:
        """Rows of the physical table: every SparseCore's share, one after another."""
        return self.num_sparsecores * self.rows_per_sparsecore

    def physical_row(self, table: str, ids: IdsT) -> IdsT:
        """The physical table's row of an id of a table, or elementwise of a tensor of ids."""
        sparsecore, row = self.locate(table, ids)
        return sparsecore * self.rows_per_sparsecore + row


def _stack_key(config: SparseCoreEmbeddingConfig) -> str:
    if config.stack_table_name is not None:
        return config.stack_table_name
    kind = "pooled" if config.is_pooled else "sequence"
    return f"stack_d{config.embedding_dim}_{kind}_{config.dtype}".replace("torch.", "")


def plan_stacks(configs: Sequence[SparseCoreEmbeddingConfig], num_sparsecores: int, *,
                weighted: bool = True) -> list[StackSpec]:
    """Groups tables into stacks (by stack_table_name, else by dim, kind and dtype);
    ``weighted``: whether the stacks take a KJT's weights (StackSpec.weighted)."""
    if num_sparsecores <= 0:
        raise ValueError(f"num_sparsecores must be positive, got {num_sparsecores}")
    groups: dict[str, list[SparseCoreEmbeddingConfig]] = {}
    for config in configs:
        groups.setdefault(_stack_key(config), []).append(config)
    stacks = []
    for name, tables in groups.items():
        first = tables[0]
        for t in tables[1:]:
            if (t.embedding_dim, t.is_pooled, t.dtype) != (first.embedding_dim, first.is_pooled, first.dtype):
                raise ValueError(
                    f"stack {name!r}: table {t.name!r} (dim {t.embedding_dim}, pooled={t.is_pooled}, {t.dtype}) "
                    f"cannot share a physical table with {first.name!r} (dim {first.embedding_dim}, "
                    f"pooled={first.is_pooled}, {first.dtype}); give it another stack_table_name"
                )
        placements, offset = {}, 0
        for k, t in enumerate(tables):
            rotation = k % num_sparsecores
            rows = -(-(t.num_embeddings + rotation) // num_sparsecores)
            placements[t.name] = TablePlacement(rotation=rotation, row_offset=offset, rows_per_sparsecore=rows)
            offset += rows
        stacks.append(StackSpec(name=name, tables=tuple(tables), num_sparsecores=num_sparsecores, placements=placements,
                                weighted=weighted))
    return stacks
