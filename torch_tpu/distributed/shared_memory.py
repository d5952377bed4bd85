"""The same-host transport of ``tpu_dist``: a shared-memory segment per group.

The ranks of a group that all run on one host exchange tensors (tpu ones, and
cpu ones in the same collectives: a rank may pass either) through a segment of
shared memory that every one of them maps (the stand-in for the
ICI links between a host's TPU chips); ``torch_tpu/csrc/TpuShmChannel.h`` has
its layout and protocol. This module sets the segment up when a group is
made: rank 0 creates it under ``/dev/shm``, the others open it, and the group
uses it only if every rank could, so a group spanning hosts keeps to gloo
alone. The name is removed from ``/dev/shm`` as soon as every rank has it
mapped, so no file outlives the processes.

``TORCH_TPU_DIST_TRANSPORT``: ``auto`` (the default: shared memory when every
rank is on one host) or ``gloo`` (gloo for every collective).
``TORCH_TPU_DIST_SLOT_BYTES``: bytes each rank moves per round (4 MiB).
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "gloo")
DEFAULT_SLOT_BYTES = 4 << 20
_DIRECTORY = "/dev/shm"


def requested_transport() -> str:
    """The transport ``TORCH_TPU_DIST_TRANSPORT`` asks for; raises on an unknown value."""
    value = os.environ.get("TORCH_TPU_DIST_TRANSPORT", "auto").strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"TORCH_TPU_DIST_TRANSPORT={value!r}: expected one of {', '.join(TRANSPORTS)}")
    return value


def slot_bytes() -> int:
    """Bytes per rank per round (``TORCH_TPU_DIST_SLOT_BYTES``); raises on a bad value."""
    raw = os.environ.get("TORCH_TPU_DIST_SLOT_BYTES", str(DEFAULT_SLOT_BYTES))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 4096:
        raise ValueError(f"TORCH_TPU_DIST_SLOT_BYTES={raw!r}: expected a whole number of bytes, at least 4096")
    return value


def attach(store: dist.Store, rank: int, world_size: int, group_name: str,
           timeout: datetime.timedelta) -> bool:
    """Gives the group its shared-memory segment, if every rank can map it; collective over the group.

    Returns whether the group uses it. ``store`` is the group's own (prefixed) store.
    """
    # A destroyed group of the same name (torch reuses names) leaves its channel behind.
    torch.ops.torch_tpu._close_shared_memory(group_name)
    if world_size == 1 or requested_transport() == "gloo" or dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # DETAIL wraps the backend to check every call; that needs the calls to reach gloo.
        return False
    size = slot_bytes()
    timeout_ms = int(timeout.total_seconds() * 1000)
    if rank == 0:
        path = os.path.join(_DIRECTORY, f"torch_tpu_dist_{uuid.uuid4().hex}")
        opened = torch.ops.torch_tpu._open_shared_memory(group_name, path, rank, world_size, size, True, timeout_ms)
        store.set("tpu_dist/shm/path", path if opened else "")  # only once the segment is whole
    else:
        path = store.get("tpu_dist/shm/path").decode()
        opened = bool(path) and torch.ops.torch_tpu._open_shared_memory(group_name, path, rank, world_size, size,
                                                                         False, timeout_ms)
    # Waiters tell a dead peer by its process id, so every rank must see the others' processes
    # (ranks in other pid namespaces but one /dev/shm keep to gloo).
    store.set(f"tpu_dist/shm/pid/{rank}", str(os.getpid()))
    visible = all(os.path.exists(f"/proc/{int(store.get(f'tpu_dist/shm/pid/{r}'))}") for r in range(world_size))
    store.set(f"tpu_dist/shm/opened/{rank}", "1" if opened and visible else "0")
    everyone = all(store.get(f"tpu_dist/shm/opened/{r}") == b"1" for r in range(world_size))
    if rank == 0 and opened:
        os.unlink(path)  # every rank has mapped it, or given up on it
    if not everyone:
        torch.ops.torch_tpu._close_shared_memory(group_name)
        logger.info("tpu_dist: group %r keeps to gloo: not every rank could share memory with the others "
                    "(ranks on several hosts, or a full %s)", group_name, _DIRECTORY)
        return False
    logger.debug("tpu_dist: group %r (rank %d of %d) on shared memory, %d bytes a slot",
                 group_name, rank, world_size, size)
    return True


def group_transport(group: dist.ProcessGroup | None = None) -> str:
    """What carries the tpu collectives of a ``tpu_dist`` group: ``"shared_memory"`` or ``"gloo"``.

    ``group``: the default group when None. ``"shared_memory"`` covers
    all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor and
    all_to_all_single on tpu and cpu tensors; the rest always go through gloo.
    """
    return "shared_memory" if torch.ops.torch_tpu._has_shared_memory(channel_name(group)) else "gloo"


def channel_name(group: dist.ProcessGroup | None = None) -> str:
    """The name the group's channel is kept under (the default group when None)."""
    return (group if group is not None else dist.group.WORLD).group_name
