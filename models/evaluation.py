"""Validation of a click model: AUC and log loss over a data split."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torchmetrics.classification import BinaryAUROC

from data.loader import Batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> dict[str, float]:
    """``{"auc", "log_loss", "samples"}`` of the model's predicted click probabilities."""
    was_training = model.training
    model.eval()
    auroc = BinaryAUROC()
    loss_sum, count = 0.0, 0
    try:
        for batch in batches:
            logits = model(batch.dense.to(device), batch.sparse).squeeze(-1).float().cpu()
            loss_sum += float(torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"))
            count += len(batch)
            auroc.update(torch.sigmoid(logits), batch.labels.long())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluation got no batches")
    return {"auc": float(auroc.compute()), "log_loss": loss_sum / count, "samples": count}
