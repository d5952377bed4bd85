"""Training checkpoints: written atomically, read back with clear errors.

A checkpoint is one ``torch.save`` file holding the model, both optimizers
(the SparseCore engine's fused one and the dense one), where the run stands
(epoch, batch within it, step) and the run's config. It is written to a
temporary file in the same directory, flushed to disk and renamed over the
old one, so a crash mid-write leaves the previous checkpoint as it was.

A sharded run (several ranks) writes a ``torch.distributed.checkpoint``
directory instead, every rank its part, with the same atomicity: written
beside the old one, then swapped in by rank 0 once every rank is done.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import torch

FORMAT = "torch_tpu.dlrm-checkpoint.v1"
FILENAME = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, truncated, or from another run's config."""


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Runs ``write(file)`` on a temporary file beside ``path``, flushes it to disk and
    renames it over ``path``: a crash mid-write leaves the previous file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` to ``path`` atomically (temp file + fsync + rename)."""
    # Streamed: a model's tables are not copied into memory first.
    write_atomically(path, lambda f: torch.save({"format": FORMAT, **payload}, f))


def load(path: Path, required: Sequence[str] = ()) -> dict[str, Any]:
    """Reads a checkpoint written by :func:`save` (tensors on the host), which must hold the
    ``required`` entries."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {error}") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint")
    missing = [key for key in required if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: not a complete checkpoint of this run's kind "
                              f"(it holds {', '.join(k for k in payload if k != 'format')})")
    return payload


SHARDED_DIRNAME = "checkpoint.dcp"
META_FILENAME = "meta.json"


def _sharded_paths(path: Path) -> tuple[Path, Path]:
    """(being written, the previous one while the new one is swapped in)."""
    return path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")


def save_sharded(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Every rank's part of ``state`` (DTensors and replicated tensors) into the DCP
    directory ``path``, with ``meta`` (plain JSON) beside it; collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp, old = _sharded_paths(path)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save's leftovers
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's part is on disk
    if rank == 0:
        text = json.dumps({"format": FORMAT, **meta}).encode()
        write_atomically(tmp / META_FILENAME, lambda f: f.write(text))
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)  # a crash before this leaves the old one (at path, or at old)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _sharded_source(path: Path) -> Path:
    _, old = _sharded_paths(path)
    for candidate in (path, old):
        if (candidate / META_FILENAME).is_file():
            return candidate
    raise CheckpointError(f"no sharded checkpoint at {path}")


def sharded_meta(path: Path) -> dict[str, Any]:
    """The meta of the sharded checkpoint at ``path`` (or of the one a crashed swap left)."""
    source = _sharded_source(path)
    try:
        meta = json.loads((source / META_FILENAME).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{source / META_FILENAME} is not readable: {error}") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a {FORMAT} checkpoint")
    return meta


def load_sharded(path: Path, state: dict[str, Any]) -> None:
    """Fills ``state`` (the same structure ``save_sharded`` got, for this run's ranks) in place."""
    import torch.distributed.checkpoint as dcp

    source = _sharded_source(path)
    try:
        dcp.load(state, checkpoint_id=str(source))
    except Exception as error:  # DCP raises several types for missing or mismatched entries
        raise CheckpointError(f"{source} could not be loaded into this model: {error}") from error
