"""A small model trained on the tpu device: ``python -m models.demo``.

Until the DLRM trainer lands this is what ``make demo`` runs: an MLP learns a
planted rule on synthetic data, and the run prints its loss, accuracy and the
tpu memory statistics.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)


def make_data(
    num_samples: int, teacher: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels from a hidden linear teacher: a learnable rule."""
    features = torch.randn(num_samples, teacher.numel(), generator=generator)
    labels = (features @ teacher > 0).float()
    return features, labels


def make_model(num_features: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(num_features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 1),
    )


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    generator = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    teacher = torch.randn(32, generator=generator)
    features, labels = make_data(args.steps * args.batch_size, teacher, generator)
    device = torch.device(args.device)
    model = make_model(32, 128).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.BCEWithLogitsLoss()

    progress = tqdm(range(args.steps), desc=f"training on {device}", unit="step")
    for step in progress:
        batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
        x = features[batch].to(device, non_blocking=True)
        y = labels[batch].to(device, non_blocking=True)
        loss = loss_fn(model(x).squeeze(1), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            progress.set_postfix(loss=f"{loss.item():.4f}")

    with torch.no_grad():
        test_x, test_y = make_data(4096, teacher, generator)
        accuracy = ((model(test_x.to(device)).squeeze(1) > 0).float().cpu() == test_y).float().mean().item()
    logger.info("final loss %.4f, held-out accuracy %.3f", loss.item(), accuracy)
    if device.type == "tpu":
        props = torch.tpu.get_device_properties(device)
        logger.info(
            "%s: %.1f MiB allocated, %.1f MiB peak, capacity %.1f GiB, matmul precision %s",
            props.name,
            torch.tpu.memory_allocated(device) / 2**20,
            torch.tpu.max_memory_allocated(device) / 2**20,
            props.total_memory / 2**30,
            torch.tpu.get_float32_matmul_precision(),
        )
    return accuracy


if __name__ == "__main__":
    main()
