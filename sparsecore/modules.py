"""TorchRec-compatible embedding modules on the SparseCore engine.

``SparseCoreEmbeddingCollection`` does the same for sequence (unpooled)
features: ``forward(KJT) -> dict[str, JaggedTensor]`` like TorchRec's
``EmbeddingCollection``, with ``embeddings.<table>.weight`` keys.

``SparseCoreEmbeddingBagCollection`` takes the configs TorchRec's
``EmbeddingBagCollection`` takes and gives what it gives: ``forward(KJT) ->
KeyedTensor`` with the same keys, order and ``state_dict`` keys
(``embedding_bags.<table>.weight``). Inside, tables are stacked and
mod-sharded over the device's SparseCores (sparsecore.stacking); the
state_dict shows each table in its logical row order.

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

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from sparsecore.collection import SparseCoreCollection
from sparsecore.preprocess import PreprocessedBatch


class SparseCoreEmbeddingBagCollection(SparseCoreCollection):
    """Pooled embedding tables on the SparseCore, a drop-in for TorchRec's EmbeddingBagCollection."""

    _weight_prefix = "embedding_bags"
    _pooled = True

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return [t.config for t in self._configs]

    def forward(self, features: KeyedJaggedTensor | PreprocessedBatch) -> KeyedTensor:
        batch, outputs = self._lookup_all(features)
        pooled: dict[str, torch.Tensor] = {}
        for stack in self._stacks:
            for slot, feature in enumerate(stack.feature_names):
                pooled[feature] = outputs[stack.name][slot * batch.batch_size:(slot + 1) * batch.batch_size]
        keys = [f for t in self._configs for f in t.feature_names]
        dims = [t.embedding_dim for t in self._configs for _ in t.feature_names]
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat([pooled[f] for f in keys], dim=1))


class SparseCoreEmbeddingCollection(SparseCoreCollection):
    """Sequence embedding tables on the SparseCore, a drop-in for TorchRec's EmbeddingCollection."""

    _weight_prefix = "embeddings"
    _pooled = False

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return [t.config for t in self._configs]

    def forward(self, features: KeyedJaggedTensor | PreprocessedBatch) -> dict[str, JaggedTensor]:
        batch, outputs = self._lookup_all(features)
        result: dict[str, JaggedTensor] = {}
        for stack in self._stacks:
            start = 0
            for feature in stack.feature_names:
                lengths = batch.lengths[feature]
                count = int(lengths.sum())
                result[feature] = JaggedTensor(
                    values=outputs[stack.name][start:start + count], lengths=lengths.to(outputs[stack.name].device))
                start += count
        return {f: result[f] for t in self._configs for f in t.feature_names}
