"""SparseCore table configurations: TorchRec's configs plus the SparseCore limits.

A :class:`SparseCoreEmbeddingConfig` wraps a TorchRec ``EmbeddingBagConfig``
(pooled features) or ``EmbeddingConfig`` (sequence features) and adds what
the SparseCore needs to size its buffers. Names follow TorchRec's
``experimental/torch_tpu``. Plain TorchRec configs are accepted anywhere and
wrapped with the defaults (:func:`as_sparsecore_config`).

Example::

    >>> from torchrec import EmbeddingBagConfig
    >>> cfg = SparseCoreEmbeddingConfig(
    ...     config=EmbeddingBagConfig(name="t0", num_embeddings=1000, embedding_dim=16, feature_names=["f0"]),
    ...     max_ids_per_partition=64,
    ...     max_unique_ids_per_partition=32,
    ... )
    >>> cfg.name, cfg.embedding_dim, cfg.combiner_name
    ('t0', 16, 'sum')
"""

from __future__ import annotations

import copy
import math
import numbers
import dataclasses
from typing import Any, Literal

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType

from sparsecore.errors import ConfigError

TorchRecConfig = EmbeddingBagConfig | EmbeddingConfig

# Table storage types the engine supports; optimizer math is fp32 for all.
TABLE_DTYPES: dict[DataType, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseCoreEmbeddingConfig:
    """One embedding table on the SparseCore. Frozen: change it with ``dataclasses.replace``."""

    config: TorchRecConfig
    """The TorchRec table config (copied, so later changes to the original do not leak in)."""
    max_ids_per_partition: int = 256
    """Most ids (after in-sample dedup) one partition may carry, e.g. ``256``. A partition is
    (the batch slice one SparseCore receives) x (the SparseCore that owns the rows)."""
    max_unique_ids_per_partition: int = 256
    """Most distinct ids one partition may carry, e.g. ``256``; at most max_ids_per_partition."""
    suggested_coo_buffer_size_per_device: int | None = None
    """Entries the COO buffers of the table's stack hold per device at least, e.g. ``65536``:
    a smaller batch's buffers are padded to it, so batches up to it have one shape (a compiled
    step traces them once). None: each batch's buffers as wide as it needs (in steps, see
    ``sparsecore.preprocess.bucket_width``). The most of a stack's tables counts."""
    max_seq_len: int | None = None
    """Sequence (unpooled) tables only: ids kept per sample, e.g. ``20``; None keeps all."""
    combiner: Literal["sqrtn"] | None = None
    """``"sqrtn"`` pools by sum / sqrt(sum of squared weights), a SparseCore-only combiner;
    None pools as the TorchRec config says (SUM or MEAN)."""
    stack_table_name: str | None = None
    """Tables with the same stack name (and dim) share one physical table, e.g. ``"stack_16"``;
    None lets the engine stack equal-dim tables itself."""

    def __post_init__(self) -> None:
        if not isinstance(self.config, (EmbeddingBagConfig, EmbeddingConfig)):
            raise ConfigError("?", "config", type(self.config).__name__, "a torchrec EmbeddingBagConfig or EmbeddingConfig")
        object.__setattr__(self, "config", copy.copy(self.config))
        cfg, name = self.config, self.config.name

        def positive(field: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, field, value, "a positive integer")

        positive("num_embeddings", cfg.num_embeddings)
        positive("embedding_dim", cfg.embedding_dim)
        positive("max_ids_per_partition", self.max_ids_per_partition)
        positive("max_unique_ids_per_partition", self.max_unique_ids_per_partition)
        if self.max_unique_ids_per_partition > self.max_ids_per_partition:
            raise ConfigError(
                name, "max_unique_ids_per_partition", self.max_unique_ids_per_partition,
                f"at most max_ids_per_partition ({self.max_ids_per_partition})",
            )
        if self.suggested_coo_buffer_size_per_device is not None:
            positive("suggested_coo_buffer_size_per_device", self.suggested_coo_buffer_size_per_device)
        if not cfg.feature_names:
            cfg.feature_names = [name]  # as TorchRec's collections do: the table serves its namesake feature
        if cfg.data_type not in TABLE_DTYPES:
            raise ConfigError(name, "data_type", cfg.data_type, f"one of {[d.name for d in TABLE_DTYPES]}")
        if self.is_pooled:
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ConfigError(name, "pooling", cfg.pooling, "PoolingType.SUM or PoolingType.MEAN")
            if self.max_seq_len is not None:
                raise ConfigError(name, "max_seq_len", self.max_seq_len, "None for a pooled (EmbeddingBagConfig) table")
        else:
            if self.max_seq_len is not None:
                positive("max_seq_len", self.max_seq_len)
            if self.combiner is not None:
                raise ConfigError(name, "combiner", self.combiner, "None for a sequence (EmbeddingConfig) table")
        if self.combiner not in (None, "sqrtn"):
            raise ConfigError(name, "combiner", self.combiner, 'None or "sqrtn"')

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def num_embeddings(self) -> int:
        return self.config.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.config.embedding_dim

    @property
    def feature_names(self) -> list[str]:
        return list(self.config.feature_names)

    @property
    def is_pooled(self) -> bool:
        return isinstance(self.config, EmbeddingBagConfig)

    @property
    def pooling(self) -> PoolingType:
        return self.config.pooling if self.is_pooled else PoolingType.NONE

    @property
    def combiner_name(self) -> str:
        """How bags are combined: ``"sum"``, ``"mean"``, ``"sqrtn"`` or ``"none"`` (sequence)."""
        if not self.is_pooled:
            return "none"
        return self.combiner or self.config.pooling.name.lower()

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of the table's weights."""
        return TABLE_DTYPES[self.config.data_type]

    @property
    def init_fn(self) -> Any:
        return self.config.init_fn


def as_sparsecore_config(config: SparseCoreEmbeddingConfig | TorchRecConfig) -> SparseCoreEmbeddingConfig:
    """Wraps a plain TorchRec config with the default limits; passes ours through."""
    if isinstance(config, SparseCoreEmbeddingConfig):
        return config
    return SparseCoreEmbeddingConfig(config=config)


OBSERVED_LIMIT_KEYS = ("max_ids_per_partition", "max_unique_ids_per_partition")
"""What ``observed_limits()`` reports per table, and ``with_observed_limits`` reads."""


def check_observed_limits(observed: dict[str, dict[str, int]]) -> None:
    """Refuses observed limits (read back from a file, say) whose counts are missing, not
    integers or negative, naming the table, the key and the value."""
    for table, seen in observed.items():
        for key in OBSERVED_LIMIT_KEYS:
            value = seen.get(key)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"table {table!r} has {key} {value!r}; expected a count >= 0")


def with_observed_limits(tables: list[SparseCoreEmbeddingConfig], observed: dict[str, dict[str, int]],
                         headroom: float = 1.25) -> list[SparseCoreEmbeddingConfig]:
    """The tables with their partition limits taken from ``observed`` (a module's
    ``observed_limits()`` from an earlier run, e.g. read back from its JSON) times
    ``headroom``, rounded up; tables it does not name keep their limits."""
    if not headroom >= 1.0:  # NaN too
        raise ValueError(f"headroom {headroom}: expected >= 1.0 (below the observed maxima, batches like the "
                         "observed ones would exceed the limits)")
    unknown = sorted(set(observed) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"limits for unknown tables {unknown}; the tables are {[t.name for t in tables]}")
    check_observed_limits(observed)
    out = []
    for t in tables:
        seen = observed.get(t.name)
        if seen is None:
            out.append(t)
            continue
        ids = max(1, math.ceil(seen["max_ids_per_partition"] * headroom))
        unique = min(ids, max(1, math.ceil(seen["max_unique_ids_per_partition"] * headroom)))
        out.append(dataclasses.replace(t, max_ids_per_partition=ids, max_unique_ids_per_partition=unique))
    return out
