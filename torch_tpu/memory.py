"""Memory statistics of the emulated HBM (``torch.tpu.memory_*``).

The same numbers as ``torch.accelerator``: both read the tpu allocator.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from torch_tpu.device import _device_t, _index


def memory_allocated(device: _device_t = None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device: _device_t = None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


def memory_reserved(device: _device_t = None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


def max_memory_reserved(device: _device_t = None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


def memory_stats(device: _device_t = None) -> OrderedDict[str, Any]:
    return torch.accelerator.memory_stats(_index(device))


def reset_peak_memory_stats(device: _device_t = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: _device_t = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def mem_get_info(device: _device_t = None) -> tuple[int, int]:
    """(free, total) bytes of the device's emulated HBM."""
    return torch.accelerator.get_memory_info(_index(device))


def empty_cache() -> None:
    """Nothing is cached: freed tensors return to the host at once."""
    torch.accelerator.empty_cache()
