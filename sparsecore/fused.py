"""The autograd shape of a fused table (DESIGN.md §4).

``sparsecore::fused_lookup`` is the lookup whose backward, instead of
returning a table gradient, runs the optimizer on the touched rows in place
(``sparsecore::backward_update``). A zero-size placeholder that requires grad
carries the autograd edge: the table itself is not differentiated, so no
dense table gradient exists and DDP sees nothing to reduce. Being a custom op
with a fake kernel, it traces whole under ``torch.compile``.

``trained_rows`` gives the same shape to rows looked up elsewhere (on the
SparseCore executor): the forward's kernels run there, the autograd node is
made in the training thread. A deferred update only queues the optimizer
step on the executor, so the dense backward goes on meanwhile; the
executor's order keeps it ahead of the table's next lookup.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsecore import _library  # noqa: F401  (registers torch.ops.sparsecore)
from sparsecore.executor import executor_for


@torch.library.custom_op("sparsecore::fused_lookup", mutates_args=())
def fused_lookup(
    placeholder: torch.Tensor,
    weight: torch.Tensor,
    state: list[torch.Tensor],
    step: torch.Tensor,
    hyper: torch.Tensor,
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    num_bags: int,
    batch_size: int,
    optimizer: int,
    deferred: bool,
) -> torch.Tensor:
    """The lookup; its backward steps ``optimizer`` (an sparsecore.optim kernel code) on the rows,
    or (``deferred``) queues that step on the SparseCore executor."""
    return torch.ops.sparsecore.lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags, batch_size)


@fused_lookup.register_fake
def _fused_lookup_fake(placeholder, weight, state, step, hyper, row_pointers, embedding_ids, sample_ids, gains,
                       num_bags, batch_size, optimizer, deferred):
    return weight.new_empty(num_bags, weight.shape[1], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    _, weight, state, step, hyper, row_pointers, embedding_ids, sample_ids, gains, _, batch_size, optimizer, deferred = inputs
    ctx.optimizer, ctx.batch_size, ctx.deferred = optimizer, batch_size, deferred
    ctx.num_state = len(state)
    ctx.save_for_backward(weight, step, hyper, row_pointers, embedding_ids, sample_ids, gains, *state)


def fused_update(weight: torch.Tensor, state: list[torch.Tensor], step: torch.Tensor, hyper: torch.Tensor,
                 coo: tuple, optimizer: int, deferred: bool, grad_output: torch.Tensor) -> None:
    """The optimizer on the rows a lookup touched, given its output's gradient; ``deferred``:
    queued on the SparseCore executor instead. ``coo`` is (row_pointers, embedding_ids,
    sample_ids, gains, num_bags, batch_size)."""
    row_pointers, embedding_ids, sample_ids, gains, _, batch_size = coo
    update = torch.ops.sparsecore.backward_update
    args = (weight, state, step, grad_output, row_pointers, embedding_ids, sample_ids, gains, batch_size, optimizer)
    if deferred:
        # The hyperparameters as of now: an LR scheduler may step before the update runs.
        executor_for(weight.device).defer("sparse update", update, *args, hyper.clone())
    else:
        update(*args, hyper)


def exchanged_update(weight: torch.Tensor, state: list[torch.Tensor], step: torch.Tensor, hyper: torch.Tensor,
                     coo: tuple, optimizer: int, exchange: Callable, rows_per_sparsecore: int,
                     grad_output: torch.Tensor) -> None:
    """``fused_update`` split around ``exchange(rows, grads) -> (rows, grads, row_mean_sq | None)``
    between the batch's (touched rows, summed gradients) and the optimizer step (e.g.
    combining them across devices: sparsecore.distributed). Always inline: exchanges are
    collectives, which must keep the calling thread's order."""
    row_pointers, embedding_ids, sample_ids, gains, _, batch_size = coo
    rows, grads = torch.ops.sparsecore.row_gradients(grad_output, row_pointers, embedding_ids, sample_ids, gains,
                                                     batch_size, rows_per_sparsecore)
    rows, grads, row_mean_sq = exchange(rows, grads)
    torch.ops.sparsecore.apply_rows(weight, state, step, rows, grads, optimizer, hyper, row_mean_sq)


def _backward(ctx, grad_output):
    weight, step, hyper, row_pointers, embedding_ids, sample_ids, gains, *state = ctx.saved_tensors
    fused_update(weight, state, step, hyper, (row_pointers, embedding_ids, sample_ids, gains, None, ctx.batch_size),
                 ctx.optimizer, ctx.deferred, grad_output)
    # No gradient for anything: the update is the backward's whole effect.
    return None, None, [None] * ctx.num_state, *(None,) * 10


fused_lookup.register_autograd(_backward, setup_context=_setup_context)


def placeholder(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(0, device=device, requires_grad=True)


class _TrainedRows(torch.autograd.Function):
    """Rows computed elsewhere (a lookup on the SparseCore executor, without autograd)
    joined to the graph here: the backward hands their gradient to ``update``."""

    @staticmethod
    def forward(ctx, placeholder, rows, update):
        ctx.update = update
        return rows

    @staticmethod
    def backward(ctx, grad_output):
        ctx.update(grad_output)
        return None, None, None


def trained_rows(placeholder: torch.Tensor, rows: torch.Tensor, update: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """``rows`` as an autograd output whose backward is ``update(grad)`` (``fused_update`` or
    ``exchanged_update`` with all but the gradient bound). Called in the training thread, its
    node is ordered among that thread's: the backward reaches it as soon as its gradient is
    ready, not after every node of the dense arch."""
    return _TrainedRows.apply(placeholder, rows, update)
