"""DLRM and DLRM-DCNv2 with their embeddings on the SparseCore engine.

The constructors, submodule names (so ``state_dict`` keys) and the
``forward(dense_features, sparse_features)`` contract are TorchRec's
(``torchrec.models.dlrm``): these classes subclass TorchRec's and only change
how a step runs. The sparse lookup is submitted to the SparseCore executor
first and the dense arch runs on the TensorCore meanwhile; the pooled
embeddings come back as one ``(B, F x D)`` block that is viewed as
``(B, F, D)`` without TorchRec's per-feature split and concatenation; the
dot interaction on tpu is one fused op each way (DotInteraction).
``sparse_features`` may also be a ``sparsecore.PreprocessedBatch`` that a
loader prepared ahead.
"""

from __future__ import annotations

import torch
from torchrec.models import dlrm as torchrec_dlrm
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import PreprocessedBatch, SparseCoreEmbeddingBagCollection
from torch_tpu.interaction import dot_interaction


def _check_engine(ebc) -> None:
    if not isinstance(ebc, SparseCoreEmbeddingBagCollection):
        raise TypeError(f"embedding_bag_collection must be a sparsecore.SparseCoreEmbeddingBagCollection, "
                        f"got {type(ebc).__name__}; use torchrec.models.dlrm for TorchRec's own modules")


class _SparseCoreForward:
    """The step both models share: overlapped lookup, then interaction and over arch."""

    def forward(self, dense_features: torch.Tensor,
                sparse_features: KeyedJaggedTensor | PreprocessedBatch) -> torch.Tensor:
        pooled = self.sparse_arch.embedding_bag_collection.forward_async(sparse_features)
        embedded_dense = self.dense_arch(dense_features)
        return self.forward_from_pooled(embedded_dense, pooled.result().values())

    def forward_from_pooled(self, embedded_dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The step after the lookup: interaction and over arch, given the dense arch's output and
        the pooled embeddings (B, F x D) (e.g. looked up elsewhere, as an XLA export's caller does)."""
        embedded_sparse = pooled.view(-1, self.sparse_arch.F, self.sparse_arch.D)
        interacted = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return self.over_arch(interacted)


class _Gram(torch.autograd.Function):
    """``x @ x^T`` per sample, whose backward is one batched matmul, ``(g + g^T) @ x``,
    where autograd's own (x and x^T as two operands) takes two and adds them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.bmm(x, x.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.bmm(grad + grad.transpose(1, 2), x)


class DotInteraction(torchrec_dlrm.InteractionArch):
    """TorchRec's dot interaction. On tpu one fused op each way
    (``torch_tpu.interaction.dot_interaction``: no concatenations, no full
    Gram matrix in memory, no gather). Elsewhere the upper triangle is taken
    by one flat ``index_select`` (its backward one ``index_add``) instead of
    two-tensor advanced indexing, whose backward is a slower accumulating
    index_put, and the Gram matrix's backward is one batched matmul instead of
    two (_Gram)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        rows, cols = self.triu_indices
        self.register_buffer("flat_triu", rows * (self.F + 1) + cols, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        if dense_features.device.type == "tpu":
            return dot_interaction(dense_features, sparse_features)
        return self.unfused(dense_features, sparse_features)

    def unfused(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """The interaction off tpu (on tpu too, for comparison: benchmarks.interaction)."""
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        interactions = _Gram.apply(combined).flatten(1)
        return torch.cat((dense_features, interactions.index_select(1, self.flat_triu)), dim=1)


class DLRM(_SparseCoreForward, torchrec_dlrm.DLRM):
    """DLRM (dot interaction) over a ``SparseCoreEmbeddingBagCollection``; arguments as TorchRec's DLRM."""

    def __init__(self, embedding_bag_collection: SparseCoreEmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: list[int], over_arch_layer_sizes: list[int],
                 dense_device: torch.device | None = None) -> None:
        _check_engine(embedding_bag_collection)
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes,
                         over_arch_layer_sizes, dense_device)
        self.inter_arch = DotInteraction(self.sparse_arch.F)


class DLRM_DCN(_SparseCoreForward, torchrec_dlrm.DLRM_DCN):
    """DLRM with a low-rank DCNv2 interaction (the MLPerf model); arguments as TorchRec's DLRM_DCN."""

    def __init__(self, embedding_bag_collection: SparseCoreEmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: list[int], over_arch_layer_sizes: list[int], dcn_num_layers: int,
                 dcn_low_rank_dim: int, dense_device: torch.device | None = None) -> None:
        _check_engine(embedding_bag_collection)
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes,
                         over_arch_layer_sizes, dcn_num_layers, dcn_low_rank_dim, dense_device)


class DLRMTrain(torch.nn.Module):
    """A DLRM with its loss, for training loops and ``sparsecore.TrainPipeline``:
    ``forward(batch) -> (loss, (loss, logits, labels))`` (detached outputs), as
    TorchRec's ``DLRMTrain``. The batch has ``dense``, ``sparse`` and ``labels``
    (data.loader.Batch). The loss is binary cross-entropy summed over the batch's
    samples and divided by ``loss_divisor`` (default: the batch size, a mean);
    a rank of a distributed run divides by the global batch size instead, so that
    summed gradients are the global batch's mean (models.distributed)."""

    def __init__(self, model: torch.nn.Module, loss_divisor: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_divisor = loss_divisor

    def forward(self, batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense, batch.sparse).squeeze(-1)
        divisor = self.loss_divisor or len(batch.labels)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / divisor
        return loss, (loss.detach(), logits.detach(), batch.labels)
