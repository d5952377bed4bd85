"""Converting between TorchRec's embedding modules and the SparseCore ones.

Both directions keep configs, weights and ``is_weighted``, so outputs are identical. The
SparseCore-only ``sqrtn`` combiner and ``max_seq_len`` truncation have no
TorchRec equivalent: converting such a table to TorchRec is refused.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from sparsecore.collection import SparseCoreCollection
from sparsecore.errors import ConfigError
from sparsecore.modules import SparseCoreEmbeddingBagCollection, SparseCoreEmbeddingCollection
from sparsecore.optim import Optimizer


def from_torchrec(
    module: EmbeddingBagCollection | EmbeddingCollection,
    optimizer: Optimizer | tuple | None = None,
    device: torch.device | str | None = None,
) -> SparseCoreCollection:
    """The SparseCore module with the TorchRec module's tables and weights."""
    if isinstance(module, EmbeddingBagCollection):
        engine = SparseCoreEmbeddingBagCollection(module.embedding_bag_configs(), optimizer, device,
                                                  is_weighted=module.is_weighted())
    elif isinstance(module, EmbeddingCollection):
        engine = SparseCoreEmbeddingCollection(module.embedding_configs(), optimizer, device)
    else:
        raise TypeError(f"from_torchrec takes a torchrec EmbeddingBagCollection or EmbeddingCollection, got {type(module).__name__}")
    engine.load_state_dict(module.state_dict())
    return engine


def to_torchrec(engine: SparseCoreCollection) -> EmbeddingBagCollection | EmbeddingCollection:
    """The TorchRec module (on the CPU) with the SparseCore module's tables and weights."""
    for t in engine._configs:
        if t.combiner == "sqrtn":
            raise ConfigError(t.name, "combiner", "sqrtn", "sum or mean: TorchRec has no sqrtn pooling")
        if t.max_seq_len is not None:
            raise ConfigError(t.name, "max_seq_len", t.max_seq_len,
                              "None: TorchRec's EmbeddingCollection does not truncate sequences")
    configs = [t.config for t in engine._configs]
    if isinstance(engine, SparseCoreEmbeddingBagCollection):
        module = EmbeddingBagCollection(tables=configs, is_weighted=engine.is_weighted())
    else:
        module = EmbeddingCollection(tables=configs)
    module.load_state_dict({k: v.cpu() for k, v in engine.state_dict().items()})
    return module
