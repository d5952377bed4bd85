"""Combining a stack's row gradients across ranks before its optimizer steps.

The engine's backward can be split around an exchange (``set_row_exchange``):
the batch's touched rows and their summed gradients come out, go through one
of these, and the optimizer steps on what comes back. Sparse throughout: only
touched rows travel, never a dense table gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather_v(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's tensor (first dims may differ), rank order."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]]), group=group)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    if tensor.shape[0] == longest:
        padded = tensor.contiguous()
    else:  # the padding is never read: no need to zero it
        padded = tensor.new_empty(longest, *tensor.shape[1:])
        padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[:n] for p, n in zip(parts, sizes)]


def merge_across_ranks(rows: torch.Tensor, grads: torch.Tensor, group: dist.ProcessGroup | None):
    """Replicated tables (data_parallel): every rank's (rows, gradients), summed per row.

    Every rank gets the same rows in the same order with the same sums, so the
    replicas take the same step and stay equal."""
    all_rows = torch.cat(_all_gather_v(rows, group))
    all_grads = torch.cat(_all_gather_v(grads, group))
    unique, inverse = torch.unique(all_rows, return_inverse=True)
    summed = all_grads.new_zeros(unique.numel(), all_grads.shape[1]).index_add_(0, inverse, all_grads)
    return unique, summed, None


def whole_row_statistic(rows: torch.Tensor, grads: torch.Tensor, group: dist.ProcessGroup | None, dim: int):
    """Column shards of one table (column_wise) under row-wise Adagrad: each shard's sum of
    squared gradients per row, summed over the shards, is the whole row's; divided by the
    table's dim it is the statistic the optimizer needs. The shards see the same ids, so
    the same rows: in row order they line up."""
    order = torch.argsort(rows)
    squares = torch.linalg.vector_norm(grads.float(), dim=1).square()
    in_row_order = squares.index_select(0, order)
    dist.all_reduce(in_row_order, group=group)
    # Back to the gradients' order (moving the [rows] statistic, not the [rows, width] gradients).
    squares.index_copy_(0, order, in_row_order)
    return rows, grads, squares / dim
