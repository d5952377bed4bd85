"""Gradients for a KJT's weights: TorchRec's position-weighted features.

A weighted bag pools ``sum_i gain_i * row(id_i)`` with ``gain_i = w_i`` (sum) or
``w_i / len`` (mean). The engine folds the weights into its COO gains as
constants; when they require grad (TorchRec's ``PositionWeightedModule`` makes
them from a parameter), the pooled output passes through ``with_weight_gradient``,
whose backward gives each weight ``d loss / d w_i = scale_i * <gradient of its bag's
output, row(id_i)>``, over the rows as the lookup read them (read at the forward:
the fused updates step them in the backward).

sqrtn bags (``w_i / sqrt(sum w^2)``) are not linear in the weights and dropped ids
leave no trace of which were dropped: both are refused. The rows' read and the
gradient are two ops (``sparsecore::kjt_weight_rows``, ``sparsecore::kjt_weight_gradient``)
of shapes fixed by the KJT's, so a ``torch.compile`` step keeps them in its graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.errors import InputError
from sparsecore.stacking import StackSpec
from sparsecore.traced_preprocess import KEY_SEPARATOR, registered


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


@dataclasses.dataclass(frozen=True)
class _Entries:
    """One feature's ids within the KJT's values: ``values[start:end]``, bags of ``lengths``."""

    start: int
    end: int
    lengths: torch.Tensor
    slot: _Slot


def _entries(lengths: torch.Tensor, keys: str, stride: int, module: str) -> list[_Entries]:
    """The KJT's features that hold ids (``keys`` joined by KEY_SEPARATOR), for the module
    registered as ``module``."""
    owner = registered(module)
    slots = _slots(owner.table_configs, owner.stacks)
    names = keys.split(KEY_SEPARATOR) if keys else []
    per_feature = lengths.view(len(names), stride).long() if names else lengths.long()
    out, start = [], 0
    for name, bag_lengths, count in zip(names, per_feature, per_feature.sum(1).tolist()):
        if count:
            out.append(_Entries(start, start + count, bag_lengths, slots[name]))
        start += count
    return out


def _widest(module: str) -> int:
    return max(t.embedding_dim for t in registered(module).table_configs)


@torch.library.custom_op("sparsecore::kjt_weight_rows", mutates_args=())
def kjt_weight_rows(pooled: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, tables: list[torch.Tensor],
                    keys: str, stride: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``pooled`` (the module's output for the KJT) copied, and per id of the KJT the fp32 row
    it looks up, zero-padded to the widest table's dim: (ids, widest dim), on the tables'
    device. ``tables``: the module's stacks' physical tables in order; ``module``: its
    registered key (sparsecore.traced_preprocess).

    The copy is what the rest of the step reads: it ties the rows' read to the forward. Rows
    that only the backward needs would be read in the compiled backward (AOTAutograd's
    partitioner moves such ops there), after a later call's backward stepped them."""
    owner = registered(module)
    # A traced step refuses here, when it runs: raised while tracing, eager's InputError
    # would reach the caller as Dynamo's "Observed exception" (fullgraph=True).
    check_trainable(owner.table_configs, owner._allow_id_dropping)
    stack_tables = dict(zip((s.name for s in owner.stacks), tables))
    device = tables[0].device
    rows = torch.zeros((values.numel(), _widest(module)), dtype=torch.float32, device=device)
    for part in _entries(lengths, keys, stride, module):
        ids = values[part.start:part.end].to(device, torch.long)
        physical = part.slot.stack.physical_row(part.slot.table.name, ids)
        rows[part.start:part.end, :part.slot.table.embedding_dim] = stack_tables[part.slot.stack.name].index_select(
            0, physical).float()
    return pooled.clone(), rows


@kjt_weight_rows.register_fake
def _kjt_weight_rows_fake(pooled, values, lengths, tables, keys, stride, module):
    rows = torch.empty((values.shape[0], _widest(module)), dtype=torch.float32, device=tables[0].device)
    return torch.empty_like(pooled), rows


def _kjt_weight_rows_setup(ctx, inputs: tuple, output: tuple) -> None:
    ctx.num_tables = len(inputs[3])


def _kjt_weight_rows_backward(ctx, grad: torch.Tensor, grad_rows: torch.Tensor | None) -> tuple:
    # The copy passes its gradient through; the rows are read, not trained through.
    return grad, None, None, [None] * ctx.num_tables, None, None, None


kjt_weight_rows.register_autograd(_kjt_weight_rows_backward, setup_context=_kjt_weight_rows_setup)


@torch.library.custom_op("sparsecore::kjt_weight_gradient", mutates_args=())
def kjt_weight_gradient(grad: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, keys: str, stride: int,
                        module: str) -> torch.Tensor:
    """Per id, the gradient of its weight given ``grad``, that of the pooled (B, sum of dims)
    output: ``scale * <grad of its bag's columns, its row>`` over ``rows`` (kjt_weight_rows)."""
    out = torch.zeros(rows.shape[0], dtype=torch.float32, device=grad.device)
    for part in _entries(lengths, keys, stride, module):
        bag_lengths = part.lengths.to(grad.device)
        bags = torch.repeat_interleave(torch.arange(stride, device=grad.device), bag_lengths)
        dim, column = part.slot.table.embedding_dim, part.slot.column
        dots = (rows[part.start:part.end, :dim].to(grad.device)
                * grad[:, column:column + dim].float().index_select(0, bags)).sum(1)
        if part.slot.table.combiner_name == "mean":
            dots = dots / bag_lengths.index_select(0, bags)
        out[part.start:part.end] = dots
    return out


@kjt_weight_gradient.register_fake
def _kjt_weight_gradient_fake(grad, rows, lengths, keys, stride, module):
    return torch.empty(rows.shape[0], dtype=torch.float32, device=grad.device)


class _WeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                keys: str, stride: int, module: str) -> torch.Tensor:
        ctx.save_for_backward(rows, lengths)
        ctx.keys, ctx.stride, ctx.module = keys, stride, module
        ctx.weights_dtype, ctx.weights_device = weights.dtype, weights.device
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, lengths = ctx.saved_tensors
        gradient = torch.ops.sparsecore.kjt_weight_gradient(grad, rows, lengths, ctx.keys, ctx.stride, ctx.module)
        return grad, gradient.to(ctx.weights_device, ctx.weights_dtype), None, None, None, None, None


def with_weight_gradient(values: torch.Tensor, features: KeyedJaggedTensor, tables: Sequence[torch.Tensor],
                         module: str) -> torch.Tensor:
    """``values``, the pooled output of ``features`` by the module registered as ``module``
    (its stacks' ``tables``), through a node whose backward also gives the KJT's weights their
    gradient. The rows are read now, as the lookup read them: a module called twice before
    one backward steps its rows in the later call's backward, which runs first. Both halves
    are ops of fixed shapes given the KJT's, so a compiled step keeps them in its graph."""
    keys = KEY_SEPARATOR.join(features.keys())
    # Traced, the step reads the op's copy of the output, which keeps the read in the forward;
    # eager runs the op now anyway and hands it nothing to copy.
    compiling = torch.compiler.is_compiling()
    copied, rows = kjt_weight_rows(values if compiling else values.new_empty(0), features.values(),
                                   features.lengths(), list(tables), keys, features.stride(), module)
    values = copied if compiling else values
    return _WeightGradient.apply(values, features.weights(), rows, features.lengths(), keys, features.stride(),
                                 module)
