"""Training batches: ``(dense, KeyedJaggedTensor or sparsecore.PreprocessedBatch, labels)``.

A global batch is a run of consecutive rows of the source; an epoch visits
the global batches in an order fixed by ``(seed, epoch)``. With a process
group each rank takes its own contiguous slice of every global batch, so
``world_size`` ranks together see exactly the rows a single process would.
Nothing depends on timing or worker count: the same ``(seed, epoch, batch)``
gives the same rows, which is what makes resuming a run exact.

The SparseCore engine's host preprocessing (``sparsecore.Preprocessor``, plain
data) can run here, in worker processes, ahead of the training step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data.samples import Samples
from sparsecore import PreprocessedBatch, Preprocessor


class Source(Protocol):
    """Anything with a length and a row range: data.synthetic.SyntheticCriteo, ArraySource."""

    def __len__(self) -> int: ...

    def rows(self, start: int, stop: int) -> Samples: ...


class ArraySource:
    """A split of the binary store (data.arrays.CriteoArrays) as a Source."""

    def __init__(self, arrays) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays)

    def rows(self, start: int, stop: int) -> Samples:
        a = self.arrays
        sparse = np.asarray(a.sparse[start:stop])
        return Samples(dense=np.array(a.dense[start:stop]), sparse=[sparse[:, f:f + 1] for f in range(sparse.shape[1])],
                       labels=np.array(a.labels[start:stop]))


@dataclasses.dataclass(frozen=True)
class Batch:
    dense: torch.Tensor
    """(B, 13) float32 on the host."""
    sparse: KeyedJaggedTensor | PreprocessedBatch
    labels: torch.Tensor
    """(B,) float32 on the host."""

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Dense features and labels on ``device``; the sparse features stay on the host,
        where the SparseCore engine's preprocessing (or input distribution) reads them."""
        return Batch(dense=self.dense.to(device, non_blocking=non_blocking), sparse=self.sparse,
                     labels=self.labels.to(device, non_blocking=non_blocking))


class BatchLoader:
    """Iterates one epoch of batches; call :meth:`set_epoch` between epochs, as with DistributedSampler."""

    def __init__(self, source: Source, batch_size: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, preprocessor: Preprocessor | None = None, num_workers: int = 0,
                 drop_last: bool = True) -> None:
        if batch_size <= 0 or batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} must be a positive multiple of world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if len(source) < batch_size:
            raise ValueError(f"the source has {len(source)} rows, fewer than one batch of {batch_size}")
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.preprocessor, self.num_workers = preprocessor, num_workers
        self.drop_last = drop_last
        self.epoch = 0
        self.start_batch = 0

    def __len__(self) -> int:
        """Global batches per epoch (a last partial batch is dropped unless ``drop_last`` is False)."""
        full = len(self.source) // self.batch_size
        return full + (not self.drop_last and self._last_rows() > 0)

    def _last_rows(self) -> int:
        """Rows of the last partial batch, kept when ``drop_last`` is False: the largest multiple
        of the world size, so every rank gets a slice of one size (what gathering the ranks'
        results across them needs), none of them empty."""
        rest = len(self.source) % self.batch_size
        return rest - rest % self.world_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The epoch to iterate next, from its ``start_batch``-th batch (to resume mid-epoch)."""
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch {start_batch} out of range for {len(self)} batches")
        self.epoch, self.start_batch = epoch, start_batch

    def order(self, epoch: int) -> np.ndarray:
        """The global batch indices of an epoch, in visiting order."""
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self))

    def batch(self, index: int) -> Batch:
        """This rank's slice of global batch ``index``."""
        first = index * self.batch_size
        rows = self.batch_size if first + self.batch_size <= len(self.source) else self._last_rows()
        local = rows // self.world_size
        start = first + self.rank * local
        samples = self.source.rows(start, start + local)
        kjt = samples.kjt()
        sparse = self.preprocessor(kjt) if self.preprocessor is not None else kjt
        return Batch(dense=torch.from_numpy(samples.dense), sparse=sparse, labels=torch.from_numpy(samples.labels))

    def __iter__(self) -> Iterator[Batch]:
        indices = self.order(self.epoch)[self.start_batch:]
        if self.num_workers == 0:
            return (self.batch(int(i)) for i in indices)
        loader = torch.utils.data.DataLoader(_Indexed(self, indices), batch_size=None, num_workers=self.num_workers,
                                             prefetch_factor=2, collate_fn=_identity)
        return iter(loader)


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, loader: BatchLoader, indices: np.ndarray) -> None:
        self.loader, self.indices = loader, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Batch:
        return self.loader.batch(int(self.indices[i]))


def _identity(batch: Batch) -> Batch:
    return batch
