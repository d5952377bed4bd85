"""The SparseCore engine's own executor: a tpu stream.

SparseCore work (host preprocessing and the lookup) submitted here runs in
order on the stream's worker thread, so it overlaps TensorCore work issued
from the main thread; the kernels release the GIL. Being a tpu stream,
``torch.tpu.synchronize()`` waits for it and events order it against other
streams.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch


class SparseCoreExecutor:
    """One ordered queue of SparseCore work per device."""

    def __init__(self, device: torch.device | str = "tpu"):
        self.device = torch.device(device)
        self.stream = torch.tpu.Stream(self.device)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        # torch.tpu.submit carries the caller's grad mode and thread count over.
        return torch.tpu.submit(self.stream, fn, *args, **kwargs)

    def synchronize(self) -> None:
        self.stream.synchronize()


_executors: dict[torch.device, SparseCoreExecutor] = {}


def executor_for(device: torch.device | str) -> SparseCoreExecutor:
    """The device's executor, created on first use."""
    device = torch.device(device)
    if device.type == "tpu" and device.index is None:
        device = torch.device("tpu", torch.tpu.current_device())
    if device not in _executors:
        _executors[device] = SparseCoreExecutor(device)
    return _executors[device]
