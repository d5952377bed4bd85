"""The autograd shape of a fused table (DESIGN.md §4).

The table is not differentiated: a zero-size placeholder that requires grad
carries the autograd edge, and the backward hands the pooled gradient to an
updater that applies the optimizer to the touched rows in place. So no dense
table gradient exists, and DDP sees no gradient to reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsecore.kernels import lookup

Updater = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, weight, row_pointers, embedding_ids, sample_ids, gains, num_bags, updater):
        ctx.updater = updater
        ctx.save_for_backward(row_pointers, embedding_ids, sample_ids, gains)
        return lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.updater(grad_output, *ctx.saved_tensors)
        return (None,) * 8


def placeholder(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(0, device=device, requires_grad=True)
