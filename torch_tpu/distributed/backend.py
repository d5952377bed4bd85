"""The ``tpu_dist`` process-group backend: gloo's transport for tpu and cpu tensors.

One gloo backend serves both devices of a ``tpu_dist`` group. torch routes a
collective on tpu tensors to the PrivateUse1 kernels of the ``c10d`` ops; the
core replaces those (``torch_tpu/csrc/TpuCollectives.cpp``) with one that
hands gloo CPU tensors on the same memory, and builds ``PREMUL_SUM``, which
gloo lacks. Gloo's own TCP pairs carry the data, so the group spans hosts
exactly as a gloo group does (torchrun's rendezvous, any ``init_method``).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKEND = "tpu_dist"
"""The name to pass to ``torch.distributed.init_process_group``."""


def _bind_local_device() -> None:
    """Each process of a host takes ``tpu:<LOCAL_RANK>`` when the host has several devices."""
    count = torch.tpu.device_count()
    local_rank = os.environ.get("LOCAL_RANK")
    if count <= 1 or local_rank is None:
        return
    if int(local_rank) >= count:
        raise RuntimeError(
            f"tpu_dist: LOCAL_RANK={local_rank} but this host has {count} tpu devices "
            f"(tpu:0..tpu:{count - 1}); start at most {count} processes per host"
        )
    torch.tpu.set_device(int(local_rank))


def _create_backend(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.ProcessGroupGloo:
    torch.ops.torch_tpu._register_collectives()  # once per process
    _bind_local_device()
    logger.debug("tpu_dist: rank %d of %d on gloo, timeout %s", rank, world_size, timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def register() -> None:
    """Makes ``init_process_group("tpu_dist")`` available (once; torch_tpu's import calls it)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, devices=["cpu", "tpu"])
