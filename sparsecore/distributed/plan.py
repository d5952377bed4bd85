"""The sharding plan: which ranks hold which table, and how. Plain data, JSON on disk.

A plan is what the planner emits and what a user may write by hand::

    {"version": 1, "world_size": 2, "chip": "v5p", "sparsecores_per_chip": 4,
     "hosts": [[0, 1]],
     "tables": {"t_small": {"sharding_type": "table_wise", "ranks": [1]},
                "t_big":   {"sharding_type": "row_wise",   "ranks": [0, 1]},
                "t_wide":  {"sharding_type": "column_wise", "ranks": [0, 1], "column_widths": [32, 32]}}}

Sharding types carry TorchRec's names (``torchrec.distributed.types.ShardingType``):

* ``table_wise``: the whole table on its one rank.
* ``row_wise``: rows mod-sharded over every SparseCore of the listed ranks, as
  on a TPU pod: id ``i`` lives on global SparseCore ``i % (len(ranks) * n)``.
* ``column_wise``: column slices of ``column_widths`` on the listed ranks, in order.
* ``table_row_wise``: ``row_wise`` within one host: ``ranks`` is one of ``hosts``.
* ``data_parallel``: a replica on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparsecore.config import SparseCoreEmbeddingConfig, TorchRecConfig, as_sparsecore_config
from sparsecore.errors import SparseCoreError

PLAN_VERSION = 1

TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE, DATA_PARALLEL = (
    "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
SHARDING_TYPES = (TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE, DATA_PARALLEL)

COMPUTE_OPTIONS = {"max_ids_per_partition": int, "max_unique_ids_per_partition": int}
"""Per-table compute options a plan may set, overriding the table config's."""


class PlanError(SparseCoreError):
    """A plan that does not fit the tables or the world: names what is wrong and what was expected."""


def _is_int(value: Any) -> bool:
    """A true integer: JSON's true/false are ints to Python, but no rank or width."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(field: str, value: Any) -> tuple[int, ...]:
    """A JSON list of integers as a tuple; PlanError naming ``field`` otherwise."""
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
        raise PlanError(f"{field} {value!r}; expected a list of integers")
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSharding:
    """How one table is sharded."""

    sharding_type: str
    """One of SHARDING_TYPES, e.g. ``"row_wise"``."""
    ranks: tuple[int, ...]
    """Ranks holding the table's shards, in shard order, e.g. ``(0, 1)``."""
    column_widths: tuple[int, ...] | None = None
    """column_wise only: the width of each rank's slice, summing to the dim, e.g. ``(32, 32)``."""
    compute: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Options from COMPUTE_OPTIONS, e.g. ``{"max_ids_per_partition": 1024}``."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sharding_type": self.sharding_type, "ranks": list(self.ranks)}
        if self.column_widths is not None:
            out["column_widths"] = list(self.column_widths)
        if self.compute:
            out["compute"] = dict(self.compute)
        return out

    @classmethod
    def from_dict(cls, table: str, data: Mapping[str, Any]) -> TableSharding:
        unknown = set(data) - {"sharding_type", "ranks", "column_widths", "compute"}
        if unknown:
            raise PlanError(f"table {table!r}: unknown field(s) {sorted(unknown)}; expected sharding_type, ranks, "
                            f"column_widths, compute")
        if "sharding_type" not in data or "ranks" not in data:
            raise PlanError(f"table {table!r}: sharding_type and ranks are required")
        if not isinstance(data["sharding_type"], str):
            raise PlanError(f"table {table!r}: sharding_type {data['sharding_type']!r}; expected one of "
                            f"{list(SHARDING_TYPES)}")
        widths, compute = data.get("column_widths"), data.get("compute", {})
        if not isinstance(compute, Mapping):
            raise PlanError(f"table {table!r}: compute {compute!r}; expected an object of options from "
                            f"{sorted(COMPUTE_OPTIONS)}")
        return cls(sharding_type=data["sharding_type"], ranks=_int_list(f"table {table!r}: ranks", data["ranks"]),
                   column_widths=None if widths is None else _int_list(f"table {table!r}: column_widths", widths),
                   compute=dict(compute))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Per table, its sharding over a world of ranks (one tpu device each)."""

    world_size: int
    """Ranks in the process group, e.g. ``2``."""
    tables: Mapping[str, TableSharding]
    """Per table name: its sharding. Every table of the module appears once."""
    chip: str = "v5p"
    """The chip the plan was made for (torch_tpu.chips), e.g. ``"v5p"``."""
    sparsecores_per_chip: int = 4
    """SparseCores per device, e.g. ``4``: row-wise sharding spreads rows over ranks x this."""
    hosts: tuple[tuple[int, ...], ...] | None = None
    """Ranks of each host, e.g. ``((0, 1), (2, 3))``; None: one host holds every rank."""
    version: int = PLAN_VERSION

    @property
    def host_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.hosts if self.hosts is not None else (tuple(range(self.world_size)),)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "world_size": self.world_size, "chip": self.chip,
                               "sparsecores_per_chip": self.sparsecores_per_chip}
        if self.hosts is not None:
            out["hosts"] = [list(h) for h in self.hosts]
        out["tables"] = {name: t.to_dict() for name, t in self.tables.items()}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        version = data.get("version")
        if not _is_int(version) or version != PLAN_VERSION:
            raise PlanError(f"plan format version {version!r} is not supported; expected {PLAN_VERSION}")
        unknown = set(data) - {"version", "world_size", "chip", "sparsecores_per_chip", "hosts", "tables"}
        if unknown:
            raise PlanError(f"unknown plan field(s) {sorted(unknown)}")
        if "world_size" not in data or "tables" not in data:
            raise PlanError("a plan needs world_size and tables")
        for field in ("world_size", "sparsecores_per_chip"):
            if field in data and (not _is_int(data[field]) or data[field] <= 0):
                raise PlanError(f"{field}={data[field]!r}; expected a positive integer")
        if not isinstance(data.get("chip", ""), str):
            raise PlanError(f"chip={data['chip']!r}; expected a chip name, e.g. \"v5p\"")
        hosts, tables = data.get("hosts"), data["tables"]
        if hosts is not None and not isinstance(hosts, (list, tuple)):
            raise PlanError(f"hosts {hosts!r}; expected a list of each host's ranks, e.g. [[0, 1], [2, 3]]")
        if not isinstance(tables, Mapping):
            raise PlanError(f"tables {type(tables).__name__}; expected an object {{table name: its sharding}}")
        for name, t in tables.items():
            if not isinstance(t, Mapping):
                raise PlanError(f"table {name!r}: {t!r}; expected an object {{sharding_type, ranks, ...}}")
        return cls(world_size=data["world_size"], chip=data.get("chip", "v5p"),
                   sparsecores_per_chip=data.get("sparsecores_per_chip", 4),
                   hosts=None if hosts is None else tuple(_int_list(f"hosts[{i}]", h) for i, h in enumerate(hosts)),
                   tables={name: TableSharding.from_dict(name, t) for name, t in tables.items()},
                   version=version)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise PlanError(f"a plan is a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan as JSON, atomically (a crash leaves any previous file whole)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json() + "\n")
            os.replace(tmp, path)
        except BaseException:
            # The write or the rename failed (a full disk, path a folder): leave no temp file behind.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> ShardingPlan:
        return cls.from_json(Path(path).read_text())

    def validate(self, tables: Sequence[SparseCoreEmbeddingConfig | TorchRecConfig]) -> None:
        """Raises PlanError naming the first thing that does not fit these tables and this world."""
        self.validate_dims({c.name: c.embedding_dim for c in map(as_sparsecore_config, tables)})

    def validate_dims(self, dims: Mapping[str, int]) -> None:
        """``validate`` against tables given as name -> embedding dim (all a plan's checks need),
        e.g. the planner's TableSpecs."""
        if not _is_int(self.world_size) or self.world_size <= 0:
            raise PlanError(f"world_size={self.world_size!r}; expected a positive integer")
        if not _is_int(self.sparsecores_per_chip) or self.sparsecores_per_chip <= 0:
            raise PlanError(f"sparsecores_per_chip={self.sparsecores_per_chip!r}; expected a positive integer")
        self._validate_hosts()
        unknown = sorted(set(self.tables) - set(dims))
        if unknown:
            raise PlanError(f"the plan shards unknown table(s) {unknown}; the module's tables are {sorted(dims)}")
        missing = sorted(set(dims) - set(self.tables))
        if missing:
            raise PlanError(f"the plan has no sharding for table(s) {missing}")
        for name, sharding in self.tables.items():
            self._validate_table(name, sharding, dims[name])

    def _validate_hosts(self) -> None:
        ranks = [r for h in self.host_groups for r in h]
        if sorted(ranks) != list(range(self.world_size)):
            raise PlanError(f"hosts {self.host_groups} must hold every rank 0..{self.world_size - 1} exactly once")

    def _validate_table(self, name: str, sharding: TableSharding, dim: int) -> None:
        kind, ranks = sharding.sharding_type, sharding.ranks
        if kind not in SHARDING_TYPES:
            raise PlanError(f"table {name!r}: sharding_type {kind!r} is unknown; expected one of {SHARDING_TYPES}")
        if not ranks:
            raise PlanError(f"table {name!r}: ranks is empty; expected at least one rank")
        for r in ranks:
            if not _is_int(r) or not 0 <= r < self.world_size:
                raise PlanError(f"table {name!r}: rank {r!r} is out of range; expected 0 <= rank < {self.world_size}")
        if kind != COLUMN_WISE and len(set(ranks)) != len(ranks):
            raise PlanError(f"table {name!r}: ranks {list(ranks)} repeat a rank ({kind} takes each rank once)")
        if kind == TABLE_WISE and len(ranks) != 1:
            raise PlanError(f"table {name!r}: table_wise takes exactly one rank, got {list(ranks)}")
        if kind == DATA_PARALLEL and sorted(ranks) != list(range(self.world_size)):
            raise PlanError(f"table {name!r}: data_parallel takes every rank 0..{self.world_size - 1}, got {list(ranks)}")
        if kind == TABLE_ROW_WISE and tuple(sorted(ranks)) not in {tuple(sorted(h)) for h in self.host_groups}:
            raise PlanError(f"table {name!r}: table_row_wise ranks {list(ranks)} must be one host's ranks, "
                            f"one of {[list(h) for h in self.host_groups]}")
        if kind == COLUMN_WISE:
            widths = sharding.column_widths
            if widths is None or len(widths) != len(ranks):
                raise PlanError(f"table {name!r}: column_wise needs one column width per rank ({len(ranks)}), "
                                f"got {None if widths is None else list(widths)}")
            if any(not _is_int(w) or w <= 0 for w in widths) or sum(widths) != dim:
                raise PlanError(f"table {name!r}: column widths {list(widths)} must be positive and sum to the "
                                f"table's dim {dim}")
        elif sharding.column_widths is not None:
            raise PlanError(f"table {name!r}: column_widths is for column_wise tables only ({kind} given)")
        for key, value in sharding.compute.items():
            if key not in COMPUTE_OPTIONS:
                raise PlanError(f"table {name!r}: compute option {key!r} is unknown; expected one of "
                                f"{sorted(COMPUTE_OPTIONS)}")
            if not isinstance(value, COMPUTE_OPTIONS[key]) or isinstance(value, bool) or value <= 0:
                raise PlanError(f"table {name!r}: compute option {key}={value!r}; expected a positive integer")


def default_plan(tables: Sequence[SparseCoreEmbeddingConfig | TorchRecConfig], world_size: int, *,
                 chip: str = "v5p", sparsecores_per_chip: int = 4) -> ShardingPlan:
    """A plan without a planner: tables larger than an even share of all the tables' bytes
    are row-wise over every rank; the rest go table-wise, each to the rank holding the
    fewest bytes so far (largest first)."""
    configs = [as_sparsecore_config(t) for t in tables]
    size = {c.name: c.num_embeddings * c.embedding_dim * c.dtype.itemsize for c in configs}
    share = sum(size.values()) / world_size
    load = [0] * world_size
    plan: dict[str, TableSharding] = {}
    for c in sorted(configs, key=lambda c: -size[c.name]):
        if world_size > 1 and size[c.name] > share:
            plan[c.name] = TableSharding(sharding_type=ROW_WISE, ranks=tuple(range(world_size)))
            load = [b + size[c.name] / world_size for b in load]
        else:
            rank = min(range(world_size), key=lambda r: load[r])
            plan[c.name] = TableSharding(sharding_type=TABLE_WISE, ranks=(rank,))
            load[rank] += size[c.name]
    ordered = {c.name: plan[c.name] for c in configs}
    return ShardingPlan(world_size=world_size, tables=ordered, chip=chip, sparsecores_per_chip=sparsecores_per_chip)
