"""Memory statistics of the emulated HBM (``torch.tpu.memory_*``).

The same numbers as ``torch.accelerator``: both read the tpu allocator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu.device import _device_t, _index
from torch_tpu.graph_breaks import F, outside_compiled_graphs


def _memory(api: str) -> Callable[[F], F]:
    # Dynamo has torch.accelerator's memory functions marked as skipped: traced, they failed
    # with Dynamo's generic message. The statistics change as the process runs: no constants.
    return outside_compiled_graphs(f"torch.tpu.{api}", "memory statistics")


@_memory("memory_allocated")
def memory_allocated(device: _device_t = None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


@_memory("max_memory_allocated")
def max_memory_allocated(device: _device_t = None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


@_memory("memory_reserved")
def memory_reserved(device: _device_t = None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


@_memory("max_memory_reserved")
def max_memory_reserved(device: _device_t = None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


@_memory("memory_stats")
def memory_stats(device: _device_t = None) -> OrderedDict[str, Any]:
    return torch.accelerator.memory_stats(_index(device))


@_memory("reset_peak_memory_stats")
def reset_peak_memory_stats(device: _device_t = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


@_memory("reset_accumulated_memory_stats")
def reset_accumulated_memory_stats(device: _device_t = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


@_memory("mem_get_info")
def mem_get_info(device: _device_t = None) -> tuple[int, int]:
    """(free, total) bytes of the device's emulated HBM."""
    return torch.accelerator.get_memory_info(_index(device))


@_memory("empty_cache")
def empty_cache() -> None:
    """Nothing is cached: freed tensors return to the host at once."""
    torch.accelerator.empty_cache()
