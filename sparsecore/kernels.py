"""SparseCore kernels as torch custom ops (``torch.ops.sparsecore.*``, C++ in csrc/).

``lookup``: the sparse x dense matmul of one stack: for every COO entry,
``out[row_of(bag)] += gain * table[owner * rows_per_sparsecore + row]``,
accumulated in fp32, where bag ``f * batch_size + b`` has output row
``b * F + f`` (F = num_bags / batch_size). The COO buffers come from sparsecore.preprocess; the physical table
holds the rows of SparseCore ``o`` at ``[o * rows_per_sparsecore, (o + 1) *
rows_per_sparsecore)``. The fused-optimizer backward is in sparsecore.fused.
"""

from __future__ import annotations

import torch

from sparsecore import _library  # noqa: F401  (registers torch.ops.sparsecore)


@torch.library.register_fake("sparsecore::lookup")
def _lookup_fake(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags, batch_size):
    return weight.new_empty(num_bags, weight.shape[1], dtype=torch.float32)


def lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags: int, batch_size: int) -> torch.Tensor:
    """(num_bags, dim) pooled rows in fp32 (as TorchRec returns for fp16/bf16 tables too)."""
    return torch.ops.sparsecore.lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags, batch_size)
