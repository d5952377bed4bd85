"""The autograd shape of a fused table (DESIGN.md §4), as a custom op.

``sparsecore::fused_lookup`` is the lookup whose backward, instead of
returning a table gradient, runs the optimizer on the touched rows in place
(``sparsecore::backward_update``). A zero-size placeholder that requires grad
carries the autograd edge: the table itself is not differentiated, so no
dense table gradient exists and DDP sees nothing to reduce. Being a custom op
with a fake kernel, it traces whole under ``torch.compile``.
"""

from __future__ import annotations

import torch

from sparsecore import _library  # noqa: F401  (registers torch.ops.sparsecore)


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
) -> torch.Tensor:
    """The lookup; its backward steps ``optimizer`` (an sparsecore.optim kernel code) on the rows."""
    return torch.ops.sparsecore.lookup(weight, row_pointers, embedding_ids, sample_ids, gains, num_bags, batch_size)


@fused_lookup.register_fake
def _fused_lookup_fake(placeholder, weight, state, step, hyper, row_pointers, embedding_ids, sample_ids, gains,
                       num_bags, batch_size, optimizer):
    return weight.new_empty(num_bags, weight.shape[1], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    _, weight, state, step, hyper, row_pointers, embedding_ids, sample_ids, gains, _, batch_size, optimizer = inputs
    ctx.optimizer, ctx.batch_size = optimizer, batch_size
    ctx.num_state = len(state)
    ctx.save_for_backward(weight, step, hyper, row_pointers, embedding_ids, sample_ids, gains, *state)


def _backward(ctx, grad_output):
    weight, step, hyper, row_pointers, embedding_ids, sample_ids, gains, *state = ctx.saved_tensors
    torch.ops.sparsecore.backward_update(weight, state, step, grad_output, row_pointers, embedding_ids,
                                         sample_ids, gains, ctx.batch_size, ctx.optimizer, hyper)
    # No gradient for anything: the update above is the backward's whole effect.
    return None, None, [None] * ctx.num_state, *(None,) * 9


fused_lookup.register_autograd(_backward, setup_context=_setup_context)


def placeholder(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(0, device=device, requires_grad=True)


class _ExchangedLookup(torch.autograd.Function):
    """The lookup whose backward is split around an exchange of row gradients: (rows,
    summed gradients) of the batch, then ``exchange`` (e.g. combining them across
    devices: sparsecore.distributed), then the optimizer on what it returns."""

    @staticmethod
    def forward(ctx, placeholder, weight, state, step, hyper, coo, optimizer, exchange, rows_per_sparsecore):
        ctx.state, ctx.step, ctx.hyper, ctx.coo = state, step, hyper, coo
        ctx.weight, ctx.optimizer, ctx.exchange, ctx.rows_per_sparsecore = weight, optimizer, exchange, rows_per_sparsecore
        return torch.ops.sparsecore.lookup(weight, *coo)

    @staticmethod
    def backward(ctx, grad_output):
        row_pointers, embedding_ids, sample_ids, gains, _, batch_size = ctx.coo
        rows, grads = torch.ops.sparsecore.row_gradients(grad_output, row_pointers, embedding_ids, sample_ids, gains,
                                                         batch_size, ctx.rows_per_sparsecore)
        rows, grads, row_mean_sq = ctx.exchange(rows, grads)
        torch.ops.sparsecore.apply_rows(ctx.weight, ctx.state, ctx.step, rows, grads, ctx.optimizer, ctx.hyper,
                                        row_mean_sq)
        return (None,) * 9


def exchanged_lookup(placeholder, weight, state, step, hyper, coo, optimizer: int, exchange,
                     rows_per_sparsecore: int) -> torch.Tensor:
    """``fused_lookup`` with ``exchange(rows, grads) -> (rows, grads, row_mean_sq | None)``
    between the backward's row gradients and the optimizer step. ``coo`` is (row_pointers,
    embedding_ids, sample_ids, gains, num_bags, batch_size)."""
    return _ExchangedLookup.apply(placeholder, weight, state, step, hyper, coo, optimizer, exchange,
                                  rows_per_sparsecore)
