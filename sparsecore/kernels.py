"""SparseCore kernels as torch custom ops (``torch.ops.sparsecore.*``).

``lookup``: the sparse x dense matmul of one stack: for every COO entry,
``out[sample] += gain * table[owner * rows_per_sparsecore + row]``, accumulated
in fp32. The COO buffers come from sparsecore.preprocess; the physical table
holds the rows of SparseCore ``o`` at ``[o * rows_per_sparsecore, (o + 1) *
rows_per_sparsecore)``.
"""

from __future__ import annotations

import torch

from sparsecore import _library  # noqa: F401  (registers torch.ops.sparsecore)
from sparsecore.preprocess import ALIGNMENT


def group_starts(row_pointers: torch.Tensor) -> torch.Tensor:
    """(receivers, owners) start offsets: each group begins at the previous end rounded up to 8."""
    ends = row_pointers.long()
    starts = torch.zeros_like(ends)
    starts[:, 1:] = (ends[:, :-1] + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    return starts


def physical_rows(row_pointers: torch.Tensor, embedding_ids: torch.Tensor, rows_per_sparsecore: int) -> torch.Tensor:
    """Row of every buffer entry in the physical (stacked) table."""
    receivers, width = embedding_ids.shape
    positions = torch.arange(width, device=embedding_ids.device).expand(receivers, width).contiguous()
    owners = torch.searchsorted(group_starts(row_pointers).contiguous(), positions, right=True) - 1
    return owners * rows_per_sparsecore + embedding_ids.long()


@torch.library.register_fake("sparsecore::lookup")
def _lookup_fake(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags):
    return weight.new_empty(num_bags, weight.shape[1], dtype=torch.float32)


def lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags: int) -> torch.Tensor:
    """(num_bags, dim) pooled rows in fp32 (as TorchRec returns for fp16/bf16 tables too)."""
    return torch.ops.sparsecore.lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags)


def row_gradients(
    grad_output: torch.Tensor, rows: torch.Tensor, samples: torch.Tensor, gains: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(touched physical rows, their summed gradients): the sparse gradient of a lookup."""
    unique_rows, inverse = torch.unique(rows, return_inverse=True)
    grads = torch.zeros(unique_rows.numel(), grad_output.shape[1], dtype=torch.float32, device=grad_output.device)
    grads.index_add_(0, inverse, grad_output.float().index_select(0, samples) * gains.unsqueeze(1))
    return unique_rows, grads


def valid_entries(row_pointers, embedding_ids, sample_ids, gains, rows_per_sparsecore: int):
    """Flat (physical row, sample, gain) of the non-padding entries."""
    rows = physical_rows(row_pointers, embedding_ids, rows_per_sparsecore).flatten()
    samples = sample_ids.flatten().long()
    valid = samples >= 0
    return rows[valid], samples[valid], gains.flatten()[valid]
