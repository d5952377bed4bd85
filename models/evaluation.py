"""Validation of a click model: AUC and log loss over a data split."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from data.loader import Batch
from data.synthetic import binary_auc

logger = logging.getLogger(__name__)


def auc_of_logits(logits: torch.Tensor, labels: torch.Tensor) -> float | None:
    """ROC AUC of the logits (``data.synthetic.binary_auc``: rank-sum in float64, ties averaged);
    None when the labels are all one class (no positive-negative pair: the AUC is undefined).

    On the logits, not on float32 probabilities: the sigmoid is monotone, so the AUC is the
    same, but in float32 it rounds every logit above ~17 to 1.0 and would tie confident
    predictions the model ranks apart (torchmetrics' BinaryAUROC takes such probabilities).
    """
    positives = labels > 0.5
    if bool(positives.all()) or not bool(positives.any()):
        return None
    return binary_auc(logits.double().numpy(), labels.numpy())


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device,
             gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float | None]:
    """``{"auc", "log_loss", "samples"}`` of the model's predicted click probabilities;
    ``auc`` is None when the labels evaluated are all one class (it is undefined then).

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
    auc = auc_of_logits(logits, labels)
    if auc is None:
        logger.warning("validation AUC undefined: all %d labels evaluated are %d (evaluate more rows, "
                       "e.g. a larger --eval-batches)", len(labels), int(labels[0] > 0.5))
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="mean"))
    return {"auc": auc, "log_loss": log_loss, "samples": len(labels)}
