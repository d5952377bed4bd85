"""sparsecore: the SparseCore embedding engine.

Sparse embedding lookups and their fused-optimizer updates run here; the
dense rest of a model is ordinary tpu tensors. TorchRec-compatible modules
(``SparseCoreEmbeddingBagCollection``, ``SparseCoreEmbeddingCollection``)
over table configs, stacking with mod sharding, host preprocessing into
per-SparseCore COO buffers (``preprocess``), C++ kernels for the lookup and
the fused-optimizer backward (``sparsecore.optim``), and ``TrainPipeline``,
which overlaps the engine's work with the TensorCore's, exactly.
"""

from sparsecore.config import SparseCoreEmbeddingConfig, as_sparsecore_config, with_observed_limits
from sparsecore import optim
from sparsecore.errors import ConfigError, InputError, PartitionLimitError, SparseCoreError
from sparsecore.convert import from_torchrec, to_torchrec
from sparsecore.modules import SparseCoreEmbeddingBagCollection, SparseCoreEmbeddingCollection
from sparsecore.preprocess import PartitionStats, PreprocessedBatch, Preprocessor, StackBatch, preprocess_stacks
from sparsecore.stacking import StackSpec, TablePlacement, plan_stacks
from sparsecore.pipeline import TrainPipeline
from sparsecore import debug_checks  # noqa: F401  (registers the kernels' Debug-mode checks)
from sparsecore import stablehlo  # noqa: F401  (registers the kernels' StableHLO export)

def preprocess(features, module) -> PreprocessedBatch:
    """Host preprocessing of a KJT for a SparseCore module, ready for its forward."""
    return module.preprocess(features)


__all__ = [
    "SparseCoreEmbeddingBagCollection",
    "SparseCoreEmbeddingCollection",
    "from_torchrec",
    "optim",
    "preprocess",
    "to_torchrec",
    "ConfigError",
    "InputError",
    "PartitionLimitError",
    "PartitionStats",
    "PreprocessedBatch",
    "Preprocessor",
    "SparseCoreEmbeddingConfig",
    "SparseCoreError",
    "StackBatch",
    "StackSpec",
    "TablePlacement",
    "TrainPipeline",
    "as_sparsecore_config",
    "plan_stacks",
    "preprocess_stacks",
    "with_observed_limits",
]
