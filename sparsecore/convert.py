"""Converting between TorchRec's embedding modules and the SparseCore ones.

Both directions keep configs, weights and ``is_weighted``, so outputs are identical. The
SparseCore-only ``sqrtn`` combiner and ``max_seq_len`` truncation have no
TorchRec equivalent: converting such a table to TorchRec is refused.

Reduced-precision tables: TorchRec's unsharded modules hold every table that is
not FP32 in float16, a ``DataType.BF16`` table too, while the SparseCore table
is what its config says (bfloat16). ``from_torchrec`` rounds the float16 rows
to bfloat16 to nearest even, bit for bit as TorchRec's own sharding of the
module does (its bfloat16 table loads the same state dict): the weights, and so
the outputs, are the sharded TorchRec module's, not the unsharded one's.
``to_torchrec`` gives bfloat16 rows back exactly within float16's normal range,
and refuses a table with values past float16's largest (they would load as
infinities).
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
    state = {k: v.cpu() for k, v in engine.state_dict().items()}
    held = module.state_dict()
    for key, value in state.items():
        _check_fits(key, value, held[key].dtype)
    module.load_state_dict(state)
    return module


def _check_fits(key: str, weight: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuses weights that TorchRec's table dtype turns into infinities: a bfloat16 table past
    float16's range would load as inf rows, silently."""
    if weight.dtype == dtype or not weight.is_floating_point():
        return
    overflowed = torch.isfinite(weight) & ~torch.isfinite(weight.to(dtype))
    if overflowed.any():
        largest = weight[overflowed].float().abs().max().item()
        raise ValueError(f"{key}: TorchRec holds this table as {dtype}, which cannot hold its "
                         f"{int(overflowed.sum())} values past {torch.finfo(dtype).max:g} (up to {largest:g}); "
                         f"scale the table or keep it in the SparseCore module")
