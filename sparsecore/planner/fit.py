"""The cost model's constants fitted to measured runs.

Two kinds of measurement, each plain data: a device's step (the work the cost
model sees in it — cost.Work: HBM bytes, ids, shards, routed ids and tables, rows merged across devices,
bytes and collectives exchanged — and the seconds it took) and one
all_to_all (bytes a device sent, seconds). Time is linear in the constants'
inverses, so each fit is a least squares on relative error with every
constant kept non-negative: first the exchanges' (ICI bandwidth, latency),
then the compute constants on the steps, less what the exchanges explain of
those timed with their exchanges. The benchmarks' JSON is turned into these
samples by benchmarks/planner_calibration.py; this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import numpy as np

from sparsecore.planner.cost import (
    COMPUTE_FEATURES,
    CostModel,
    Work,
    comm_seconds,
    compute_seconds,
    lookup_work,
)
from sparsecore.planner.specs import TableSpec
from sparsecore.planner.topology import Topology


@dataclasses.dataclass(frozen=True)
class ComputeSample:
    """One device's measured step: its work in the cost model's terms, and the seconds;
    ``with_exchanges``: the time includes the work's exchanges (a whole sharded step)."""

    work: Work
    seconds: float
    with_exchanges: bool = False


@dataclasses.dataclass(frozen=True)
class ExchangeSample:
    """One measured all_to_all: bytes a device sent to the others, and the seconds."""

    sent_bytes: float
    seconds: float


def engine_step(tables: Sequence[TableSpec], batch_size: int, seconds: float, *,
                training: bool = True) -> ComputeSample:
    """A single-device step over whole ``tables`` (every id local) as a sample."""
    work = [lookup_work(t, width=t.embedding_dim, ids=batch_size * t.pooling_factor, out_rows=batch_size,
                        remote_share=0.0, batch_ids=batch_size * t.pooling_factor, rows=t.num_embeddings,
                        training=training) for t in tables]
    return ComputeSample(work=functools.reduce(Work.__add__, work, Work()), seconds=seconds)


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| with x >= 0, by trying every subset of free columns (a has a handful)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b * b))
    for k in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
            if (x < 0).any():
                continue
            residual = float(np.sum((a[:, columns] @ x - b) ** 2))
            if residual < best_residual:
                best = np.zeros(a.shape[1])
                best[list(columns)] = x
                best_residual = residual
    return best


def _relative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    # Each row divided by its measurement: a 2 ms step's error counts as much as a 200 ms one's.
    return _nonnegative_least_squares(features / seconds[:, None], np.ones_like(seconds))


def fit_cost_model(compute: Sequence[ComputeSample], exchanges: Sequence[ExchangeSample], topology: Topology, *,
                   fitted_from: str = "") -> CostModel:
    """The constants that best explain the samples on ``topology`` (whose peak bandwidths the
    efficiencies are shares of). Needs samples that vary in bytes: at least 3 compute and 2
    exchange samples. A feature no sample has (e.g. no routed ids) gets a zero constant."""
    if len(compute) < 3 or len(exchanges) < 2:
        raise ValueError(f"fitting the cost model needs >= 3 compute and >= 2 exchange samples; got {len(compute)} "
                         f"and {len(exchanges)}")
    per_ici_byte, per_exchange = _relative_fit(
        np.array([[s.sent_bytes, 1.0] for s in exchanges], dtype=np.float64),
        np.array([s.seconds for s in exchanges], dtype=np.float64))
    if per_ici_byte <= 0:
        raise ValueError("the exchange samples show no cost per byte: they must vary in size")
    ici = CostModel(ici_efficiency=1.0 / (per_ici_byte * topology.ici_gbps * 1e9), exchange_s=float(per_exchange))
    # What the compute constants must explain: a whole step's time less its exchanges'.
    seconds = np.array([s.seconds - (comm_seconds(s.work, topology, ici) if s.with_exchanges else 0.0)
                        for s in compute], dtype=np.float64)
    keep = seconds > 0
    if keep.sum() < 3:
        raise ValueError("the exchanges alone explain the measured steps: nothing is left to fit the compute to")
    features = np.array([[getattr(s.work, f) for f in COMPUTE_FEATURES] for s in compute], dtype=np.float64)
    rates = _relative_fit(features[keep], seconds[keep])
    if rates[0] <= 0:
        raise ValueError("the compute samples show no cost per HBM byte: they must vary in size")
    per_byte, per_id, per_shard, per_routed_id, per_routed_table, per_gathered, per_statistic = map(float, rates)
    return dataclasses.replace(ici, hbm_efficiency=1.0 / (per_byte * topology.hbm_gbps * 1e9), id_s=per_id,
                               shard_s=per_shard, route_id_s=per_routed_id, route_table_s=per_routed_table,
                               gather_row_s=per_gathered, row_statistic_s=per_statistic, fitted_from=fitted_from)


def predicted_seconds(sample: ComputeSample | ExchangeSample, topology: Topology, model: CostModel) -> float:
    """What ``model`` says the sample should have taken."""
    if isinstance(sample, ExchangeSample):
        return comm_seconds(Work(exchanged_bytes=sample.sent_bytes, exchanges=1), topology, model)
    return compute_seconds(sample.work, topology, model) + (
        comm_seconds(sample.work, topology, model) if sample.with_exchanges else 0.0)
