"""Training checkpoints: written atomically, read back with clear errors.

A checkpoint is one ``torch.save`` file holding the model, both optimizers
(the SparseCore engine's fused one and the dense one), where the run stands
(epoch, batch within it, step) and the run's config. It is written to a
temporary file in the same directory, flushed to disk and renamed over the
old one, so a crash mid-write leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT = "torch_tpu.dlrm-checkpoint.v1"
FILENAME = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, truncated, or from another run's config."""


def save(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` to ``path`` atomically (temp file + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # streamed: a model's tables are not copied into memory first
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    """Reads a checkpoint written by :func:`save` (tensors on the host)."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {error}") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint")
    return payload
