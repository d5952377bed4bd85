"""Gradients for a KJT's weights: TorchRec's position-weighted features.

A weighted bag pools ``sum_i gain_i * row(id_i)`` with ``gain_i = w_i`` (sum) or
``w_i / len`` (mean). The engine folds the weights into its COO gains as
constants; when they require grad (TorchRec's ``PositionWeightedModule`` makes
them from a parameter), the pooled output passes through ``with_weight_gradient``,
whose backward gives each weight ``d loss / d w_i = scale_i * <gradient of its bag's
output, row(id_i)>``, over the rows as the lookup read them (read at the forward:
the fused updates step them in the backward).

sqrtn bags (``w_i / sqrt(sum w^2)``) are not linear in the weights and dropped ids
leave no trace of which were dropped: both are refused. Under ``torch.compile`` this
path runs eagerly (a graph break; ``fullgraph=True`` says so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.errors import InputError
from sparsecore.stacking import StackSpec


def trainable_weights(features: object) -> torch.Tensor | None:
    """The KJT's weights when a gradient is asked of them (grad mode on and they require it)."""
    if not isinstance(features, KeyedJaggedTensor) or not torch.is_grad_enabled():
        return None
    weights = features.weights_or_none()
    return weights if weights is not None and weights.requires_grad else None


def refuse_trainable_weights(features: object, where: str) -> None:
    """Raises InputError if ``features``' weights ask for a gradient ``where`` cannot give."""
    if trainable_weights(features) is not None:
        raise InputError(f"the KJT's weights require grad, but {where} gives them no gradient; pass them "
                         f"detached, or train them through SparseCoreEmbeddingBagCollection.forward")


def detached(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` with its weights detached: what the lookups take as their gains."""
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(), weights=features.weights().detach(),
                             lengths=features.lengths(), stride=features.stride())


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One feature of the pooled output: its table, stack and columns."""

    table: SparseCoreEmbeddingConfig
    stack: StackSpec
    column: int


def _slots(configs: Sequence[SparseCoreEmbeddingConfig], stacks: Sequence[StackSpec]) -> dict[str, _Slot]:
    stack_of = {t.name: s for s in stacks for t in s.tables}
    slots, column = {}, 0
    for table in configs:  # the KeyedTensor's keys and columns: TorchRec's order
        for feature in table.feature_names:
            slots[feature] = _Slot(table, stack_of[table.name], column)
            column += table.embedding_dim
    return slots


def check_trainable(configs: Sequence[SparseCoreEmbeddingConfig], allow_id_dropping: bool) -> None:
    """Raises InputError where the weights' gradient cannot be given."""
    if allow_id_dropping:
        raise InputError("the KJT's weights require grad, but allow_id_dropping may drop ids without a "
                         "trace of which; turn id dropping off to train the weights")
    sqrtn = [t.name for t in configs if t.combiner_name == "sqrtn"]
    if sqrtn:
        raise InputError(f"the KJT's weights require grad, but tables {sqrtn} pool with sqrtn, which is not "
                         f"linear in the weights; use sum or mean pooling to train them")


def weight_gradient(features: KeyedJaggedTensor, configs: Sequence[SparseCoreEmbeddingConfig],
                    stacks: Sequence[StackSpec], tables: Mapping[str, torch.Tensor]
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gradient of ``features``' weights given that of the pooled (B, sum of dims) output;
    ``tables``: each stack's physical table. The rows are read now, as the lookup read them: a
    module called twice before one backward steps its rows in the later call's backward, which
    runs first."""
    slots = _slots(configs, stacks)
    weights = features.weights()
    batch = features.stride()
    keys = features.keys()
    offsets = features.offset_per_key()
    values = features.values()
    lengths = features.lengths().view(len(keys), batch) if keys else features.lengths()
    parts = []  # per feature with ids: (start, end, rows read, bag of each id, columns, scale)
    for k, feature in enumerate(keys):
        start, end = offsets[k], offsets[k + 1]
        if start == end:
            continue
        slot = slots[feature]
        table = tables[slot.stack.name]
        ids = values[start:end].to(table.device, torch.long)
        bag_lengths = lengths[k].to(table.device, torch.long)
        bags = torch.repeat_interleave(torch.arange(batch, device=table.device), bag_lengths)
        rows = table.index_select(0, slot.stack.physical_row(slot.table.name, ids)).float()
        scale = 1.0 / bag_lengths.index_select(0, bags) if slot.table.combiner_name == "mean" else None
        parts.append((start, end, rows, bags, slot.column, slot.table.embedding_dim, scale))

    def gradient(grad: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(weights.shape, dtype=torch.float32, device=grad.device)
        for start, end, rows, bags, column, dim, scale in parts:
            dots = (rows * grad[:, column:column + dim].index_select(0, bags)).sum(1)
            out[start:end] = dots if scale is None else dots * scale
        return out.to(weights.device, weights.dtype)

    return gradient


class _WeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, weights: torch.Tensor,
                gradient: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.gradient = gradient
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.gradient(grad), None


def with_weight_gradient(values: torch.Tensor, weights: torch.Tensor,
                         gradient: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``values`` (the pooled output), through a node whose backward also gives ``weights``
    their gradient ``gradient(grad of values)``."""
    return _WeightGradient.apply(values, weights, gradient)
