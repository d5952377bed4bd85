"""The SparseCore kernels' checks for torch_tpu's Debug mode: their COO buffers in range.

Preprocessing already refuses ids outside their tables; these catch a
malformed ``PreprocessedBatch`` (built by hand, or corrupted) before a
kernel reads past a table: every entry inside its (receiver, owner) group
must name a row of the owner's partition and a bag of the batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparsecore import _library, fused  # noqa: F401  (register torch.ops.sparsecore.*)
from sparsecore.preprocess import align_up
from torch_tpu import debug


def entries_in_groups(row_pointers: torch.Tensor, width: int) -> torch.Tensor:
    """Mask [n, width] of the COO entries inside some (receiver, owner) group (not padding)."""
    ends = row_pointers.to("cpu", torch.int64)
    starts = torch.zeros_like(ends)
    starts[:, 1:] = align_up(ends[:, :-1])
    column = torch.arange(width)
    inside = (column[None, None, :] >= starts[:, :, None]) & (column[None, None, :] < ends[:, :, None])
    return inside.any(1)


def check_coo(op, weight: torch.Tensor, row_pointers: torch.Tensor, embedding_ids: torch.Tensor,
              sample_ids: torch.Tensor, num_bags: int) -> None:
    """The entries' rows within the owner's partition of ``weight``, their bags within ``num_bags``."""
    n = row_pointers.shape[0]
    valid = entries_in_groups(row_pointers, embedding_ids.shape[1]).to(embedding_ids.device)
    if not bool(valid.any()):
        return
    # Padding (outside every group) set to 0, in range: positions in the message are the buffers' own.
    debug.out_of_range(op, "embedding_ids", embedding_ids.where(valid, 0), weight.shape[0] // n,
                       "the rows of a SparseCore's partition")
    debug.out_of_range(op, "sample_ids", sample_ids.where(valid, 0), num_bags, "the bags of the batch")


def _check_lookup(op, args, kwargs) -> None:
    weight, row_pointers, embedding_ids, sample_ids, _, num_bags, _ = args
    check_coo(op, weight, row_pointers, embedding_ids, sample_ids, num_bags)


def _check_fused_lookup(op, args, kwargs) -> None:
    _, weight, _, _, _, row_pointers, embedding_ids, sample_ids, _, num_bags = args[:10]
    check_coo(op, weight, row_pointers, embedding_ids, sample_ids, num_bags)


def _check_update(op, args, kwargs) -> None:
    weight, _, _, grad_output, row_pointers, embedding_ids, sample_ids = args[:7]
    check_coo(op, weight, row_pointers, embedding_ids, sample_ids, grad_output.shape[0])


debug.register_checker(torch.ops.sparsecore.lookup.default, _check_lookup)
debug.register_checker(torch.ops.sparsecore.fused_lookup.default, _check_fused_lookup)
debug.register_checker(torch.ops.sparsecore.backward_update.default, _check_update)
debug.register_library_dir(str(Path(__file__).parent))
