"""What a shard costs a device: HBM bytes and step time.

Storage: the shard's rows (weights, fp32 optimizer state), its COO buffers
for a step's ids (12 bytes an id) and its output rows (fp32, forward and
gradient). Step time: the bytes the lookup and the update move through HBM
(distinct ids only: an id's row is read once, and updated once) at HBM
bandwidth, a fixed cost per id (preprocessing and routing them) and per
shard (launching its work), plus what the device exchanges with the others
(ids in, rows out and their gradients back) at ICI bandwidth and a latency
per exchange. ``CostModel`` holds those constants; ``fit_cost_model``
(planner/fit.py) fits them to measured runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

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
    """Seconds of latency per all_to_all a device takes part in."""
    reserved_fraction: float = 0.1
    """HBM kept free (dense arch, activations, fragmentation)."""
    fitted_from: str = ""
    """What the constants were fitted to (empty: the priors)."""

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


@functools.lru_cache(maxsize=4096)
def distinct_ids(draws: float, rows: int, zipf_alpha: float | None) -> float:
    """Expected distinct ids among ``draws`` ids of ``rows`` (uniform, or Zipf(alpha) by rank)."""
    if draws <= 0:
        return 0.0
    if zipf_alpha is None:
        return rows * -math.expm1(draws * math.log1p(-1.0 / rows)) if rows > 1 else 1.0
    head = min(rows, 1_000_000)  # the tail beyond is rarely drawn: counted as its expectation
    ranks = np.arange(1, head + 1, dtype=np.float64)
    weights = ranks ** -zipf_alpha
    tail = 0.0
    if rows > head:  # integral of x^-alpha from head to rows
        tail = (math.log(rows / head) if zipf_alpha == 1 else
                (rows ** (1 - zipf_alpha) - head ** (1 - zipf_alpha)) / (1 - zipf_alpha))
    total = weights.sum() + tail
    p = weights / total
    return float((-np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-12)))).sum() + min(tail / total * draws, rows - head))


@dataclasses.dataclass(frozen=True)
class ShardCost:
    hbm_bytes: int
    compute_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class Work:
    """What one shard does in a step, before any constant: the model's features."""

    hbm_bytes: float
    """Bytes moved through HBM: distinct rows read (lookup) and read and written with their
    optimizer state (update), COO entries, output rows and their gradients."""
    ids: float
    exchanged_bytes: float
    """Bytes sent to other devices (ids, output rows, gradients)."""


def shard_work(table: TableSpec, *, width: int, ids: float, out_rows: float, remote_share: float,
               batch_ids: float, rows: int, training: bool = True) -> Work:
    """One shard's work: ``ids`` of the batch's ``batch_ids`` ids of ``table`` looked up (which
    are distinct follows the table's id distribution), at most ``rows`` rows of ``width``,
    ``out_rows`` output rows; ``remote_share`` of its ids and rows cross to other devices."""
    distinct = min(distinct_ids(batch_ids, table.num_embeddings, table.zipf_alpha) * ids / max(batch_ids, 1e-9), rows)
    weights = width * table.element_bytes
    moved = distinct * weights + ids * COO_BYTES_PER_ID + out_rows * width * 4
    if training:
        moved += 2 * distinct * (weights + table.state_values(width) * 4) + out_rows * width * 4
    exchanged = remote_share * (ids * ID_BYTES + (2 if training else 1) * out_rows * width * 4)
    return Work(hbm_bytes=moved, ids=ids, exchanged_bytes=exchanged)


def compute_seconds(work: Work, topology: Topology, model: CostModel, shards: int = 1) -> float:
    return (work.hbm_bytes / (topology.hbm_gbps * 1e9 * model.hbm_efficiency) + work.ids * model.id_s
            + shards * model.shard_s)


def exchange_seconds(exchanged_bytes: float, topology: Topology, model: CostModel) -> float:
    return exchanged_bytes / (topology.ici_gbps * 1e9 * model.ici_efficiency)


def shard_cost(table: TableSpec, *, rows: int, width: int, ids: float, out_rows: float, remote_share: float,
               batch_ids_for_state: float, topology: Topology, model: CostModel) -> ShardCost:
    """One shard on one device: ``rows`` x ``width`` of the table, ``ids`` looked up per step
    (of which distinct: from the table's id distribution), ``out_rows`` output rows of
    ``width`` it produces, ``remote_share`` of its ids and rows crossing to other devices."""
    state = table.state_values(width)
    storage = rows * width * table.element_bytes + rows * state * 4
    buffers = ids * COO_BYTES_PER_ID + 2 * out_rows * width * 4
    work = shard_work(table, width=width, ids=ids, out_rows=out_rows, remote_share=remote_share,
                      batch_ids=batch_ids_for_state, rows=rows)
    return ShardCost(hbm_bytes=int(storage + buffers), compute_s=compute_seconds(work, topology, model),
                     comm_s=exchange_seconds(work.exchanged_bytes, topology, model))
