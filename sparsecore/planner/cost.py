"""What a shard costs a device: HBM bytes and step time.

Storage: the shard's rows (weights, fp32 optimizer state), its COO buffers
for a step's ids (12 bytes an id) and its output rows (fp32, forward and
gradient). Step time: the bytes the lookup and the update move through HBM
(distinct ids only: an id's row is read once) at HBM bandwidth, plus what
the device exchanges with the others (ids in, rows out and their gradients
back) at ICI bandwidth. ``CostModel`` holds the efficiency factors on those
bandwidths; they are the model's only free constants.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from sparsecore.planner.specs import TableSpec
from sparsecore.planner.topology import Topology

ID_BYTES = 8
COO_BYTES_PER_ID = 12  # local row, bag, gain


@dataclasses.dataclass(frozen=True)
class CostModel:
    hbm_efficiency: float = 0.5
    """Share of peak HBM bandwidth a lookup or update reaches (gathers of short rows)."""
    ici_efficiency: float = 0.7
    """Share of peak ICI bandwidth an all_to_all reaches."""
    update_passes: float = 3.0
    """HBM passes over a touched row in the update (read weight and state, write both), per lookup pass."""
    reserved_fraction: float = 0.1
    """HBM kept free (dense arch, activations, fragmentation)."""


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


def shard_cost(table: TableSpec, *, rows: int, width: int, ids: float, out_rows: float, remote_share: float,
               batch_ids_for_state: float, topology: Topology, model: CostModel) -> ShardCost:
    """One shard on one device: ``rows`` x ``width`` of the table, ``ids`` looked up per step
    (of which distinct: from the table's id distribution), ``out_rows`` output rows of
    ``width`` it produces, ``remote_share`` of its ids and rows crossing to other devices."""
    state = table.state_values(width)
    storage = rows * width * table.element_bytes + rows * state * 4
    buffers = ids * COO_BYTES_PER_ID + 2 * out_rows * width * 4
    distinct = min(distinct_ids(batch_ids_for_state, table.num_embeddings, table.zipf_alpha) * ids
                   / max(batch_ids_for_state, 1e-9), rows)
    row_bytes = width * table.element_bytes + state * 4
    hbm = distinct * row_bytes * (1 + model.update_passes) + ids * COO_BYTES_PER_ID + out_rows * width * 4
    compute = hbm / (topology.hbm_gbps * 1e9 * model.hbm_efficiency)
    exchanged = remote_share * (ids * ID_BYTES + 2 * out_rows * width * 4)
    comm = exchanged / (topology.ici_gbps * 1e9 * model.ici_efficiency)
    return ShardCost(hbm_bytes=int(storage + buffers), compute_s=compute, comm_s=comm)
