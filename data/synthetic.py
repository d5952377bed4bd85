"""Synthetic Criteo-like data, deterministic by seed, optionally with a planted signal.

Rows are generated in fixed blocks, each from its own seeded generator, so any
row range comes out the same whoever asks for it, in any order, on any rank.

Ids per table are uniform or Zipf-distributed (hot ids scattered over the
table by a fixed affine permutation, so nothing the size of a table is ever
stored); features are one-hot or carry MLPerf's multi-hot sizes. Dense
features are Criteo-like counts (log-normal, floored, some zeros).

Planted signal: labels are drawn from a hidden random *teacher*, a small DLRM
over all 39 features — a dense tower, one embedding per (table, id) that is a
pure function of the seed, linear terms and all pairwise dot interactions of
the pooled embeddings. Its parts are scaled so that a set share (at least
half) of the logit variance comes from the embeddings (a set part of that from
the interactions), and its bias so that the click rate is the one asked for. Since the labels are
Bernoulli(sigmoid(teacher logit)), the teacher's own AUC is the best any model
can reach on the data: :meth:`SyntheticCriteo.teacher_auc` reports it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data import schema
from data.samples import Samples

BLOCK_ROWS = 4096
"""Rows generated per seeded block."""

PRESETS: dict[str, tuple[int, ...]] = {
    "criteo-kaggle": schema.KAGGLE_TABLE_SIZES,
    "criteo-1tb": schema.TERABYTE_TABLE_SIZES,
}

MATERIALIZED_TEACHER_ELEMENTS = 1 << 24
"""Teacher tables up to this many numbers in all are kept in memory (float32) rather than hashed per id."""

CACHED_TEACHER_BYTES = 64 << 20
"""When they are more (the full-size presets), the smallest tables are kept as the hash gives them
(float64, the same values to the bit) up to this many bytes, and only the rest are hashed per id:
hashing costs ~70 ns a number, and at full Criteo-Kaggle sizes 20 of the 26 tables fit in 35 MiB:
2,048 rows then take 22 ms to make instead of 51 (measured here), CPU a loader worker no longer
takes from the training step's cores."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """What to generate. Table sizes are the preset's scaled by ``scale``."""

    preset: str = "criteo-kaggle"
    """``criteo-kaggle`` or ``criteo-1tb`` (data.schema)."""
    scale: float = 1.0
    """Factor on every table size, e.g. ``1e-3``; tables keep at least ``min(size, min_rows)`` rows."""
    min_rows: int = 8
    row_cap: int | None = None
    """Cap on every table's rows after scaling (e.g. 200_000), or None."""
    num_samples: int = 1_000_000
    multi_hot: bool = False
    """False: one id per feature; True: MLPerf's multi-hot sizes (data.schema.MLPERF_MULTI_HOT_SIZES)."""
    ids: str = "uniform"
    """``uniform`` or ``zipf``."""
    zipf_alpha: float = 1.05
    planted: bool = True
    """Labels from the hidden teacher; False: Bernoulli(ctr) noise."""
    teacher_dim: int = 8
    embedding_share: float = 0.7
    """Share of the teacher's logit variance that comes from the embeddings (>= 0.5)."""
    interaction_share: float = 0.1
    """Of the embeddings' share, the part carried by pairwise dot interactions (the rest is linear)."""
    logit_std: float = 2.0
    """Standard deviation of the teacher's logit: larger makes labels more predictable."""
    ctr: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r}: expected one of {sorted(PRESETS)}")
        if self.ids not in ("uniform", "zipf"):
            raise ValueError(f"ids {self.ids!r}: expected 'uniform' or 'zipf'")
        if not 0 < self.scale:
            raise ValueError(f"scale {self.scale}: expected > 0")
        if not 0.5 <= self.embedding_share < 1:
            raise ValueError(f"embedding_share {self.embedding_share}: expected 0.5 <= share < 1")
        if not 0 <= self.interaction_share <= 1:
            raise ValueError(f"interaction_share {self.interaction_share}: expected 0 <= share <= 1")
        if not 0 < self.ctr < 1:
            raise ValueError(f"ctr {self.ctr}: expected 0 < ctr < 1")
        if self.row_cap is not None and self.row_cap < 1:
            raise ValueError(f"row_cap {self.row_cap}: expected >= 1 or None")
        if self.num_samples < 0 or self.teacher_dim < 1 or self.min_rows < 1:
            raise ValueError("num_samples must be >= 0, teacher_dim and min_rows >= 1")
        if self.zipf_alpha <= 0 or self.zipf_alpha == 1.0:
            raise ValueError(f"zipf_alpha {self.zipf_alpha}: expected > 0 and != 1")

    @property
    def table_sizes(self) -> tuple[int, ...]:
        sizes = (max(min(n, self.min_rows), int(round(n * self.scale))) for n in PRESETS[self.preset])
        return tuple(sizes if self.row_cap is None else (min(n, self.row_cap) for n in sizes))

    @property
    def pooling(self) -> tuple[int, ...]:
        return schema.MLPERF_MULTI_HOT_SIZES if self.multi_hot else (1,) * schema.NUM_SPARSE


def _splitmix(x: np.ndarray) -> np.ndarray:
    """A 64-bit mixing hash, elementwise (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _coprime_multiplier(n: int, seed: int, table: int) -> int:
    """A multiplier coprime to n: id -> (a * rank + b) mod n is then a permutation."""
    a = int(_splitmix(np.array([seed * 1_000_003 + table], dtype=np.uint64))[0] % max(n, 1)) | 1
    while math.gcd(a, n) != 1:
        a += 1
    return a % n if n > 1 else 0


class SyntheticCriteo:
    """A synthetic Criteo dataset: ``rows(start, stop)`` gives any range, deterministically."""

    def __init__(self, config: SyntheticConfig):
        self.config = config
        self.table_sizes = config.table_sizes
        self.pooling = config.pooling
        rng = np.random.default_rng([config.seed, 7])
        # Dense counts: floor(exp(N(mu, sigma))) - 1, clipped at 0.
        self._dense_mu = rng.uniform(0.0, 4.0, schema.NUM_DENSE)
        self._dense_sigma = rng.uniform(0.5, 1.5, schema.NUM_DENSE)
        self._perm = [(_coprime_multiplier(n, config.seed, t), int(rng.integers(0, n))) for t, n in enumerate(self.table_sizes)]
        # The teacher.
        d = config.teacher_dim
        self._w1 = rng.normal(0, 1 / math.sqrt(schema.NUM_DENSE), (schema.NUM_DENSE, d))
        self._b1 = rng.normal(0, 0.5, d)
        self._w_dense = rng.normal(0, 1 / math.sqrt(d), d)
        self._u = rng.normal(0, 1 / math.sqrt(d), (schema.NUM_SPARSE, d))
        self._scales = (1.0, 1.0, 1.0)  # dense, linear, pairwise parts
        self._bias = 0.0
        # Small tables are materialised once, large ones hashed per id.
        self._tables: list[np.ndarray | None] = [None] * len(self.table_sizes)
        if config.planted and sum(self.table_sizes) * d <= MATERIALIZED_TEACHER_ELEMENTS:
            self._tables = [self._hashed_rows(t, np.arange(n)).astype(np.float32) for t, n in enumerate(self.table_sizes)]
        elif config.planted:
            budget = CACHED_TEACHER_BYTES
            for t in sorted(range(len(self.table_sizes)), key=lambda t: self.table_sizes[t]):
                budget -= self.table_sizes[t] * d * np.dtype(np.float64).itemsize
                if budget < 0:
                    break
                self._tables[t] = self._hashed_rows(t, np.arange(self.table_sizes[t]))
        if config.planted:
            self._calibrate()

    def __len__(self) -> int:
        return self.config.num_samples

    # ---- ids and dense counts ----

    def _ids(self, rng: np.random.Generator, table: int, count: int) -> np.ndarray:
        n = self.table_sizes[table]
        u = rng.random(count)
        if self.config.ids == "uniform":
            return np.minimum((u * n).astype(np.int64), n - 1)
        # Zipf ranks by the inverse CDF of the continuous power law on [1, n + 1).
        s = 1.0 - self.config.zipf_alpha
        rank = np.floor(((math.pow(n + 1, s) - 1.0) * u + 1.0) ** (1.0 / s)).astype(np.int64) - 1
        rank = np.clip(rank, 0, n - 1)
        a, b = self._perm[table]
        return (rank * a + b) % n

    def _draw(self, rng: np.random.Generator, rows: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Dense counts (R, 13) int64 and ids per feature (R, L_f) for `rows` samples."""
        counts = np.floor(np.exp(rng.normal(self._dense_mu, self._dense_sigma, (rows, schema.NUM_DENSE)))) - 1
        counts = np.maximum(counts, 0).astype(np.int64)
        return counts, [self._ids(rng, t, rows * p).reshape(rows, p) for t, p in enumerate(self.pooling)]

    def _block(self, block: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(dense counts (R, 13) int64, ids per feature (R, L_f) int64, labels (R,) float32) of one block."""
        start = block * BLOCK_ROWS
        rows = min(BLOCK_ROWS, self.config.num_samples - start)
        rng = np.random.default_rng([self.config.seed, 1, block])
        counts, ids = self._draw(rng, rows)
        u = rng.random(rows)
        p = 1 / (1 + np.exp(-self.logits(counts, ids))) if self.config.planted else np.full(rows, self.config.ctr)
        return counts, ids, (u < p).astype(np.float32)

    def raw_rows(self, start: int, stop: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """Rows [start, stop) as (dense counts, ids per feature, labels), before any transform."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows [{start}, {stop}) out of range for {len(self)} samples")
        parts = [self._block(b) for b in range(start // BLOCK_ROWS, -(-stop // BLOCK_ROWS))]
        if not parts:
            return np.zeros((0, schema.NUM_DENSE), np.int64), [np.zeros((0, p), np.int64) for p in self.pooling], np.zeros(0, np.float32)
        offset = start - (start // BLOCK_ROWS) * BLOCK_ROWS
        take = slice(offset, offset + stop - start)
        counts = np.concatenate([c for c, _, _ in parts])[take]
        ids = [np.concatenate([i[t] for _, i, _ in parts])[take] for t in range(schema.NUM_SPARSE)]
        labels = np.concatenate([l for _, _, l in parts])[take]
        return counts, ids, labels

    def rows(self, start: int, stop: int) -> Samples:
        counts, ids, labels = self.raw_rows(start, stop)
        return Samples(dense=np.log1p(counts).astype(np.float32), sparse=ids, labels=labels)

    # ---- the teacher ----

    def _embedding(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Teacher rows of (table, id): N(0, 1/dim) per element, a pure function of the seed."""
        cached = self._tables[table]
        return cached[ids] if cached is not None else self._hashed_rows(table, ids)

    def _hashed_rows(self, table: int, ids: np.ndarray) -> np.ndarray:
        d = self.config.teacher_dim
        key = (ids.astype(np.uint64) * np.uint64(schema.NUM_SPARSE) + np.uint64(table)) * np.uint64(d)
        salt = np.uint64((self.config.seed * 0x5851F42D4C957F2D) & 0xFFFFFFFFFFFFFFFF)  # wraps in Python, not numpy
        key = key[..., None] + np.arange(d, dtype=np.uint64) + salt
        h = _splitmix(key)
        # Two 26-bit uniforms -> one normal (Box-Muller).
        u1 = ((h >> np.uint64(38)).astype(np.float64) + 0.5) / float(1 << 26)
        u2 = ((h & np.uint64((1 << 26) - 1)).astype(np.float64) + 0.5) / float(1 << 26)
        return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2) / math.sqrt(d)

    def _parts(self, counts: np.ndarray, ids: Sequence[np.ndarray]) -> np.ndarray:
        """Unscaled (3, R) parts of the teacher's logit: dense tower, linear in the embeddings, pairwise dots."""
        x = (np.log1p(counts) - self._dense_mu) / self._dense_sigma
        dense = np.tanh(x @ self._w1 + self._b1) @ self._w_dense
        pooled = np.stack([self._embedding(t, i).mean(axis=1) for t, i in enumerate(ids)], axis=1)  # (R, 26, d)
        linear = np.einsum("rfd,fd->r", pooled, self._u)
        total = pooled.sum(axis=1)
        pairs = 0.5 * ((total * total).sum(axis=1) - (pooled * pooled).sum(axis=(1, 2)))  # sum over i < j of <e_i, e_j>
        return np.stack([dense, linear, pairs])

    def logits(self, counts: np.ndarray, ids: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(self._scales) @ self._parts(counts, ids) + self._bias

    def _calibrate(self, rows: int = 32768) -> None:
        """Scales the two parts to the asked variance split and total, and the bias to the click rate."""
        c = self.config
        parts = self._parts(*self._draw(np.random.default_rng([c.seed, 2]), rows))
        # Each part scaled to its share of the variance (the parts are uncorrelated: independent
        # dense and sparse draws, and linear and pairwise terms of zero-mean embeddings).
        shares = (1 - c.embedding_share, c.embedding_share * (1 - c.interaction_share), c.embedding_share * c.interaction_share)
        self._scales = tuple(c.logit_std * math.sqrt(share) / max(float(part.std()), 1e-12) for share, part in zip(shares, parts))
        logit = np.asarray(self._scales) @ parts
        centred = logit - logit.mean()
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection: mean sigmoid(logit + bias) == ctr
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(centred + mid)))) < c.ctr else (lo, mid)
        self._bias = (lo + hi) / 2 - float(logit.mean())

    def embedding_variance_share(self, rows: int = 32768) -> float:
        """Measured share of the teacher logit's variance that the embedding part carries."""
        counts, ids, _ = self.raw_rows(0, min(rows, len(self)))
        dense, linear, pairs = np.asarray(self._scales)[:, None] * self._parts(counts, ids)
        return float(np.var(linear + pairs) / np.var(dense + linear + pairs))

    def teacher_auc(self, start: int, stop: int) -> float:
        """AUC of the teacher's own probabilities on rows [start, stop): the best any model can reach."""
        counts, ids, labels = self.raw_rows(start, stop)
        return binary_auc(self.logits(counts, ids), labels)

    # ---- real-format output ----

    def write_tsv(self, path: str | Path, start: int = 0, stop: int | None = None) -> None:
        """Writes rows as Criteo TSV lines (label, 13 ints, 26 hex ids); one-hot data only."""
        if self.config.multi_hot:
            raise ValueError("the Criteo TSV format has one id per categorical field; multi-hot data cannot be written")
        stop = len(self) if stop is None else stop
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            for begin in range(start, stop, BLOCK_ROWS):
                counts, ids, labels = self.raw_rows(begin, min(begin + BLOCK_ROWS, stop))
                cats = np.concatenate(ids, axis=1)
                for r in range(len(labels)):
                    f.write("\t".join([str(int(labels[r])), *map(str, counts[r]), *(f"{v:08x}" for v in cats[r])]) + "\n")
        tmp.replace(path)


def binary_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged, in float64: the teacher's
    and the trainer's validation AUC (models.evaluation), exact where torchmetrics' binary_auroc
    works on float32 probabilities."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # Average ranks over runs of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    run_rank = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(run_rank, ends - starts)
    positives = labels > 0.5
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
