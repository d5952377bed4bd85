"""A block of Criteo samples as host arrays, and its KeyedJaggedTensor."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data import schema


@dataclasses.dataclass(frozen=True)
class Samples:
    """Rows of a dataset: every source (synthetic, the binary store) hands these out."""

    dense: np.ndarray
    """(B, 13) float32, log(x + 1) already applied."""
    sparse: list[np.ndarray]
    """Per categorical feature, (B, L_f) int ids: L_f ids per sample (1 for one-hot data)."""
    labels: np.ndarray
    """(B,) float32, 0 or 1."""

    def __len__(self) -> int:
        return len(self.labels)

    def slice(self, start: int, stop: int) -> Samples:
        return Samples(self.dense[start:stop], [s[start:stop] for s in self.sparse], self.labels[start:stop])

    def kjt(self) -> KeyedJaggedTensor:
        """The categorical features as a KJT keyed ``cat_0..cat_25`` (int64 values)."""
        batch = len(self)
        values = torch.from_numpy(np.concatenate([s.reshape(-1) for s in self.sparse]).astype(np.int64, copy=False))
        lengths = torch.from_numpy(np.repeat(np.array([s.shape[1] for s in self.sparse], dtype=np.int64), batch))
        return KeyedJaggedTensor(keys=list(schema.SPARSE_NAMES), values=values, lengths=lengths)
