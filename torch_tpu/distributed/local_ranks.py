"""Starting one process per emulated tpu device on this host (what torchrun does, in-process).

For tests and benchmarks of ``tpu_dist`` on one machine: each child is a fresh
(spawned) interpreter whose environment gives it ``world_size`` devices and
``LOCAL_RANK=rank``, so the ``tpu_dist`` backend binds it to ``tpu:<rank>``;
gloo is kept on the loopback interface.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking (for ``tcp://127.0.0.1:<port>``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the block (a spawned child inherits them), then restores them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_local_ranks(target: Callable[..., Any], world_size: int, args: tuple = (),
                      env: dict[str, str] | None = None) -> list[mp.Process]:
    """Spawns ``target(rank, *args)`` for every rank; returns the started processes, in rank order.

    ``env`` adds to (or overrides) each child's environment.
    """
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(world_size):
        # Read when the child imports torch: the device count, and which device is this rank's.
        child_env = {"TORCH_TPU_NUM_DEVICES": str(world_size), "LOCAL_RANK": str(rank),
                     "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
        with _environ(child_env):
            proc = ctx.Process(target=target, args=(rank, *args), name=f"tpu-rank{rank}")
            proc.start()
        procs.append(proc)
    return procs
