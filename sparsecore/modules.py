"""TorchRec-compatible embedding modules on the SparseCore engine.

``SparseCoreEmbeddingCollection`` does the same for sequence (unpooled)
features: ``forward(KJT) -> dict[str, JaggedTensor]`` like TorchRec's
``EmbeddingCollection``, with ``embeddings.<table>.weight`` keys.

``SparseCoreEmbeddingBagCollection`` takes the configs TorchRec's
``EmbeddingBagCollection`` takes and gives what it gives: ``forward(KJT) ->
KeyedTensor`` with the same keys, order and ``state_dict`` keys
(``embedding_bags.<table>.weight``); ``is_weighted`` as TorchRec's (a KJT's
weights scale its rows only when True; weights that require grad get their
gradient, as TorchRec's position-weighted features need, see
sparsecore.weight_gradient). Inside, tables are stacked and mod-sharded over
the device's SparseCores (sparsecore.stacking); the state_dict shows each
table in its logical row order.

Example (two features sharing one table)::

    >>> import torch
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    >>> ebc = SparseCoreEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f1", "f2"])],
    ...     device="cpu")
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 1]))
    >>> out = ebc(kjt)        # batch 2: f1 = [[1, 2], []], f2 = [[3], [4]]
    >>> out.keys(), tuple(out.values().shape)
    (['f1', 'f2'], (2, 8))
"""

from __future__ import annotations

import concurrent.futures
import functools

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from sparsecore.collection import SparseCoreCollection
from sparsecore.executor import Pending, Resolved, run_on
from sparsecore.inference import inference_lookups
from sparsecore.preprocess import PreprocessedBatch
from sparsecore.weight_gradient import (check_trainable, detached, refuse_trainable_weights, trainable_weights,
                                        with_weight_gradient)


class SparseCoreEmbeddingBagCollection(SparseCoreCollection):
    """Pooled embedding tables on the SparseCore, a drop-in for TorchRec's EmbeddingBagCollection."""

    _weight_prefix = "embedding_bags"
    _pooled = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Now, not at the first forward: a traced step that set it would be recompiled.
        self._column_order  # noqa: B018

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return [t.config for t in self._configs]

    def forward(self, features: KeyedJaggedTensor | PreprocessedBatch) -> KeyedTensor:
        """Pooled embeddings of every feature: TorchRec's keys and order, (B, sum of dims).

        Under ``torch.inference_mode`` a KJT is looked up without building COO buffers
        (sparsecore.inference, which says what that keeps and what it skips); so it is
        by ``forward_async``."""
        if self._serves_inference(features):
            self.wait_for_updates()
            return self._keyed(features.stride(), self._inference_lookups(features))
        if not self._trains_weights(features):
            return super().forward(features)
        return self._forward_training_weights(features)

    def _forward_training_weights(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """forward for TorchRec's position-weighted features: the weights get their gradient too."""
        if not torch.compiler.is_compiling():  # a traced step checks in sparsecore::kjt_weight_rows
            check_trainable(self._configs, self._allow_id_dropping)
        out = super().forward(detached(features))  # after the queued updates, as the lookup
        tables = [self._weights[s.name] for s in self._stacks]
        values = with_weight_gradient(out.values(), features, tables, self._traced_key)
        return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(), values=values)

    def forward_async(self, features: KeyedJaggedTensor | PreprocessedBatch) -> Pending | Resolved:
        if self._serves_inference(features):
            # Queued behind the deferred updates, as any lookup on the executor.
            looked_up = run_on(self._device, "lookup", self._inference_lookups, features)
            return Pending(looked_up, functools.partial(self._keyed, features.stride()))
        if self._trains_weights(features):  # the executor's lookups keep no autograd graph
            return Resolved(self.forward(features))
        return super().forward_async(features)

    def prefetch(self, features: KeyedJaggedTensor | PreprocessedBatch,
                 prepared: concurrent.futures.Future | None = None) -> None:
        if self._is_weighted:
            refuse_trainable_weights(features, "prefetch, which looks the batch up ahead without autograd,")
        super().prefetch(features, prepared)

    def _trains_weights(self, features: object) -> bool:
        return self._is_weighted and trainable_weights(features) is not None

    def _inference_lookups(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Per stack, the rows of the inference lookup; for a batch past the limits by its raw
        counts, those of the full preprocessing's lookups (which decides), not joined to the
        autograd graph either, whatever the grad mode where the result is taken."""
        rows = inference_lookups(features, self._stacks, {s.name: self._weights[s.name] for s in self._stacks})
        if rows is None:
            _, per_stack = self._detached_lookups(features)
            rows = {name: stack_rows for name, (stack_rows, _) in per_stack.items()}
        return rows

    def _serves_inference(self, features: KeyedJaggedTensor | PreprocessedBatch) -> bool:
        # is_compiling first: a traced step keeps the lookups in its graph, and Dynamo
        # does not trace is_inference_mode_enabled.
        return (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
                and isinstance(features, KeyedJaggedTensor) and self._device.type != "meta"
                and (self._prefetched is None or self._prefetched[0] is not features))

    def _assemble(self, batch: PreprocessedBatch, outputs: dict[str, torch.Tensor]) -> KeyedTensor:
        return self._keyed(batch.batch_size, outputs)

    def _keyed(self, size: int, outputs: dict[str, torch.Tensor]) -> KeyedTensor:
        """The stacks' (bags, dim) rows as TorchRec's KeyedTensor of a batch of ``size``."""
        # The lookup writes a stack's bags straight into its (B, features x dim)
        # block (sparsecore.kernels): a view, no copy in either direction.
        blocks = [outputs[s.name].view(size, len(s.feature_names) * s.embedding_dim) for s in self._stacks]
        values = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order.to(values.device))
        keys = [f for t in self._configs for f in t.feature_names]
        dims = [t.embedding_dim for t in self._configs for _ in t.feature_names]
        return KeyedTensor(keys=keys, length_per_key=dims, values=values)

    def _apply_gradient(self, coos: dict[str, tuple], grad: torch.Tensor, hyper: torch.Tensor) -> None:
        """The fused updates, in the calling thread, of a batch looked up without autograd
        (``_detached_lookups``, whose per-stack device COO ``coos`` are), given the gradient of
        its (B, features x dim) output and the hyperparameters to step with."""
        if self._column_order is not None:
            grad = grad.index_select(1, self._inverse_column_order.to(grad.device))
        widths = [len(s.feature_names) * s.embedding_dim for s in self._stacks]
        for stack, part in zip(self._stacks, grad.split(widths, dim=1)):
            # (B, F x D) is the stack's (bags, D) output viewed, bag f * B + b at row b * F + f.
            self._update_of(stack, coos[stack.name], hyper, deferred=False)(
                part.contiguous().view(-1, stack.embedding_dim))

    @functools.cached_property
    def _inverse_column_order(self) -> torch.Tensor:
        """The stacked blocks' column of each of TorchRec's columns (the inverse of ``_column_order``)."""
        return torch.argsort(self._column_order)

    @functools.cached_property
    def _column_order(self) -> torch.Tensor | None:
        """Columns of the stacked blocks in TorchRec's feature order; None when they already are."""
        offsets, start = {}, 0
        for s in self._stacks:
            for f in s.feature_names:
                offsets[f] = (start, s.embedding_dim)
                start += s.embedding_dim
        order = [c for t in self._configs for f in t.feature_names
                 for c in range(offsets[f][0], offsets[f][0] + offsets[f][1])]
        return None if order == list(range(start)) else torch.tensor(order)


class SparseCoreEmbeddingCollection(SparseCoreCollection):
    """Sequence embedding tables on the SparseCore, a drop-in for TorchRec's EmbeddingCollection."""

    _weight_prefix = "embeddings"
    _pooled = False

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return [t.config for t in self._configs]

    def forward(self, features: KeyedJaggedTensor | PreprocessedBatch) -> dict[str, JaggedTensor]:
        """Per feature, one embedding row per id (TorchRec's EmbeddingCollection contract)."""
        return super().forward(features)

    def _assemble(self, batch: PreprocessedBatch, outputs: dict[str, torch.Tensor]) -> dict[str, JaggedTensor]:
        result: dict[str, JaggedTensor] = {}
        for stack in self._stacks:
            out = outputs[stack.name]
            counts = [batch.id_count(f) for f in stack.feature_names]
            # One split per stack: its backward is one concatenation.
            for feature, values in zip(stack.feature_names, torch.split(out, counts)):
                result[feature] = JaggedTensor(values=values, lengths=batch.lengths[feature].to(out.device))
        return {f: result[f] for t in self._configs for f in t.feature_names}
