"""Validation of a click model: AUC and log loss over a data split."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torchmetrics.classification import BinaryAUROC

from data.loader import Batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device,
             gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
    """``{"auc", "log_loss", "samples"}`` of the model's predicted click probabilities.

    ``gather`` collects every rank's logits and labels (models.distributed.gather) so
    that ranks reading slices of the split report the metrics of the whole split.
    """
    was_training = model.training
    model.eval()
    logits, labels = [], []
    try:
        for batch in batches:
            logits.append(model(batch.dense.to(device), batch.sparse).squeeze(-1).float().cpu())
            labels.append(batch.labels)
    finally:
        model.train(was_training)
    if not logits:
        raise ValueError("evaluation got no batches")
    logits, labels = gather(torch.cat(logits)), gather(torch.cat(labels))
    auroc = BinaryAUROC()
    auroc.update(torch.sigmoid(logits), labels.long())
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="mean"))
    return {"auc": float(auroc.compute()), "log_loss": log_loss, "samples": len(labels)}
