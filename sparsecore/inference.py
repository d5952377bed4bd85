"""Inference lookups: pooled stacks looked up straight from a KeyedJaggedTensor.

Under ``torch.inference_mode`` no backward can follow a lookup, so the COO
buffers that the fused backward reads (sparsecore.preprocess) have no use:
one C++ pass per stack (csrc/InferenceLookup.cpp) validates the ids, maps
them to their rows under the stack's mod sharding and sums every bag, in KJT
order, without merging repeated ids. The sums are the COO lookup's up to
rounding: it adds a bag's merged entries owner by owner, this pass its ids
as they come.

The SparseCore limits still hold: the pass counts every partition's ids
before merging, which bounds both the merged entries and the distinct rows
from above. When that bound passes ``max_unique_ids_per_partition`` (the
smaller limit) the batch is left to the full preprocessing
(``inference_lookups`` returns None), which decides exactly, raising or
dropping ids as it does for training. The pass stops as soon as one of its
chunks alone has passed the bound, so little of it is lost when the limits
sit far below the raw counts; the lookup pays where the limits leave room
above them (as the default and the benchmark's do), while with
``max_unique_ids_per_partition`` tuned close to the distinct rows a batch
needs (``with_observed_limits``), batches with repeated ids mostly fall
back. When no receiving SparseCore's batch slice carries more ids than the
limit, no partition can, and the pass counts nothing. Batches served here
are not observed (``observed_limits``): they never build the partitions;
those that fall back are, as every preprocessed batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import _library  # noqa: F401  (registers torch.ops.sparsecore)
from sparsecore.preprocess import out_of_range, pooled_stack_args, view_kjt
from sparsecore.stacking import StackSpec


def inference_lookups(kjt: KeyedJaggedTensor, stacks: Sequence[StackSpec],
                      weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Per pooled stack, the (bags, dim) fp32 rows that ``sparsecore.kernels.lookup`` of its
    preprocessed batch would give (to rounding: repeats are summed one by one), or None when
    a partition's raw id count passes ``min(max_ids_per_partition,
    max_unique_ids_per_partition)``. ``weights``: each stack's table. Bad input raises
    ``InputError`` as preprocessing does."""
    view = view_kjt(kjt, stacks)
    rows = {}
    for stack in stacks:
        slots, args = pooled_stack_args(stack, view)
        bound = min(stack.max_ids_per_partition, stack.max_unique_ids_per_partition)
        out, bad_slot, bad_id, over = torch.ops.sparsecore.inference_lookup_pooled(weights[stack.name], *args, bound)
        if over:
            return None
        if bad_slot >= 0:
            raise out_of_range(slots, bad_slot, bad_id)
        rows[stack.name] = out
    return rows
