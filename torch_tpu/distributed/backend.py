"""The ``tpu_dist`` process-group backend: gloo, with shared memory within a host.

One gloo backend serves both devices of a ``tpu_dist`` group. torch routes a
collective on tpu tensors to the PrivateUse1 kernels of the ``c10d`` ops; the
core replaces those (``torch_tpu/csrc/TpuCollectives.cpp``) with one that
hands gloo CPU tensors on the same memory, and builds ``PREMUL_SUM``, which
gloo lacks. Gloo's own TCP pairs carry the data, so the group spans hosts
exactly as a gloo group does (torchrun's rendezvous, any ``init_method``).
When every rank of a group is on one host, the group also gets a
shared-memory segment (``shared_memory``), and the collectives the training
stack lives on — all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single — go through it, on tpu tensors and
on cpu ones alike (one rank may pass cpu tensors where another passes tpu
ones, as gloo allows: both must take the same transport). The collectives
shared memory never carries, on cpu tensors, go through the tpu kernel too
(``cpu_collectives``): it builds their ``PREMUL_SUM`` and keeps them in the
group's issue order.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu.distributed import cpu_collectives, shared_memory

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


def _create_backend(options: Any, _backend_options: Any = None) -> dist.ProcessGroupGloo:
    """The backend of a new group; ``options`` is torch's ``_DistributedBackendOptions``."""
    torch.ops.torch_tpu._register_collectives()  # once per process
    cpu_collectives.register()
    _bind_local_device()
    store, rank, world_size = options.store, options.group_rank, options.group_size
    timeout: datetime.timedelta = options.timeout
    logger.debug("tpu_dist: rank %d of %d on gloo, timeout %s", rank, world_size, timeout)
    backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    shared_memory.attach(store, rank, world_size, options.group_id, timeout)
    return backend


def register() -> None:
    """Makes ``init_process_group("tpu_dist")`` available (once; torch_tpu's import calls it)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["cpu", "tpu"])
