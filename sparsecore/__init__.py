"""sparsecore: the SparseCore embedding engine (host preprocessing, stacking, configs).

Sparse embedding lookups and their fused-optimizer updates run here; the
dense rest of a model is ordinary tpu tensors. Built so far: table configs,
stacking with mod sharding, and host preprocessing into per-SparseCore COO
buffers. Kernels and modules come next (issue 3).
"""

from sparsecore.config import SparseCoreEmbeddingConfig, as_sparsecore_config
from sparsecore.errors import ConfigError, InputError, PartitionLimitError, SparseCoreError
from sparsecore.preprocess import PartitionStats, PreprocessedBatch, StackBatch, preprocess_stacks
from sparsecore.stacking import StackSpec, TablePlacement, plan_stacks

__all__ = [
    "ConfigError",
    "InputError",
    "PartitionLimitError",
    "PartitionStats",
    "PreprocessedBatch",
    "SparseCoreEmbeddingConfig",
    "SparseCoreError",
    "StackBatch",
    "StackSpec",
    "TablePlacement",
    "as_sparsecore_config",
    "plan_stacks",
    "preprocess_stacks",
]
