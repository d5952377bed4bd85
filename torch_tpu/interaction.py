"""``dot_interaction``: DLRM's dot interaction as one differentiable tpu op.

``dot_interaction(dense, sparse)`` with dense (B, D) and sparse (B, F, D) is
``[dense, <x_i, x_j> for i < j]`` per sample, x = [dense, sparse rows], pairs
row by row: what TorchRec's ``InteractionArch`` computes by a concatenation,
a batched Gram matrix, an upper-triangle gather and another concatenation.
Here the whole of it, forward and backward, is one kernel per direction
(``csrc/TpuDotInteraction.cpp``) at the MXU precision: the same operands as
that unfused form run on tpu, each dot summed in 8-lane partial sums rather
than in order (the backward in order, as the unfused form's batched matmul).
"""

from __future__ import annotations

import torch

from torch_tpu.graph_ops import register_graph_op

_ops = torch.ops.torch_tpu


def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """(B, D + (F + 1) F / 2): ``dense`` followed by the dot products of every pair of
    ``[dense, sparse[:, 0], ..., sparse[:, F - 1]]``, pairs (i, j), i < j, row by row."""
    if dense.device.type != "tpu" or sparse.device.type != "tpu":
        raise ValueError(f"dot_interaction takes tpu tensors (it computes at the MXU precision), got dense on "
                         f"{dense.device} and sparse on {sparse.device}")
    return _ops.dot_interaction(dense, sparse)


def _setup_context(ctx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dense, sparse = ctx.saved_tensors
    return _ops.dot_interaction_backward(grad, dense, sparse)


torch.library.register_autograd("torch_tpu::dot_interaction", _backward, setup_context=_setup_context)
# Pure functions of their tensors with CPU kernels at the MXU precision: DeferAndFuse
# records them, compiled graphs call them inside (no split around the interaction).
register_graph_op(_ops.dot_interaction.default)
register_graph_op(_ops.dot_interaction_backward.default)
