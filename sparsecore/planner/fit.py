"""The cost model's constants fitted to measured runs.

Two kinds of measurement, each plain data: a device's SparseCore step (the
work the cost model sees in it — HBM bytes, ids, shards — and the seconds it
took) and one all_to_all (bytes a device sent, seconds). Step time is linear
in the constants' inverses (seconds per HBM byte, per id, per shard; per ICI
byte, per exchange), so the fit is a least squares on relative error with
every constant kept non-negative. The benchmarks' JSON is turned into these
samples by benchmarks/planner_calibration.py; this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from sparsecore.planner.cost import CostModel, Work, compute_seconds, exchange_seconds, shard_work
from sparsecore.planner.specs import TableSpec
from sparsecore.planner.topology import Topology


@dataclasses.dataclass(frozen=True)
class ComputeSample:
    """One device's measured SparseCore step: its work in the cost model's terms, and the seconds."""

    hbm_bytes: float
    ids: float
    shards: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class ExchangeSample:
    """One measured all_to_all: bytes a device sent to the others, and the seconds."""

    sent_bytes: float
    seconds: float


def engine_step(tables: Sequence[TableSpec], batch_size: int, seconds: float, *,
                training: bool = True) -> ComputeSample:
    """A single-device step over whole ``tables`` (every id local) as a sample."""
    work = [table_work(t, batch_size, training) for t in tables]
    return ComputeSample(hbm_bytes=sum(w.hbm_bytes for w in work), ids=sum(w.ids for w in work),
                         shards=len(tables), seconds=seconds)


def table_work(table: TableSpec, batch_size: int, training: bool = True) -> Work:
    ids = batch_size * table.pooling_factor
    return shard_work(table, width=table.embedding_dim, ids=ids, out_rows=batch_size, remote_share=0.0,
                      batch_ids=ids, rows=table.num_embeddings, training=training)


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
                   reserved_fraction: float = CostModel().reserved_fraction, fitted_from: str = "") -> CostModel:
    """The constants that best explain the samples on ``topology`` (whose peak bandwidths the
    efficiencies are shares of). Needs samples that vary in bytes: at least 3 compute and 2
    exchange samples."""
    if len(compute) < 3 or len(exchanges) < 2:
        raise ValueError(f"fitting the cost model needs >= 3 compute and >= 2 exchange samples; got {len(compute)} "
                         f"and {len(exchanges)}")
    per_byte, per_id, per_shard = _relative_fit(
        np.array([[s.hbm_bytes, s.ids, s.shards] for s in compute], dtype=np.float64),
        np.array([s.seconds for s in compute], dtype=np.float64))
    per_ici_byte, per_exchange = _relative_fit(
        np.array([[s.sent_bytes, 1.0] for s in exchanges], dtype=np.float64),
        np.array([s.seconds for s in exchanges], dtype=np.float64))
    if per_byte <= 0 or per_ici_byte <= 0:
        raise ValueError("the samples show no cost per byte (HBM or ICI): they must vary in size")
    return CostModel(hbm_efficiency=1.0 / (per_byte * topology.hbm_gbps * 1e9),
                     ici_efficiency=1.0 / (per_ici_byte * topology.ici_gbps * 1e9), id_s=float(per_id),
                     shard_s=float(per_shard), exchange_s=float(per_exchange), reserved_fraction=reserved_fraction,
                     fitted_from=fitted_from)


def predicted_seconds(sample: ComputeSample | ExchangeSample, topology: Topology, model: CostModel) -> float:
    """What ``model`` says the sample should have taken."""
    if isinstance(sample, ExchangeSample):
        return exchange_seconds(sample.sent_bytes, topology, model) + model.exchange_s
    return compute_seconds(Work(hbm_bytes=sample.hbm_bytes, ids=sample.ids, exchanged_bytes=0.0), topology, model,
                           shards=sample.shards)
