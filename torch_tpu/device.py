"""Device management for ``torch.tpu`` (mirrors ``torch.cuda``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu import _backend, eager
from torch_tpu.graph_breaks import F, outside_compiled_graphs

_device_t = torch.device | str | int | None

# Host cores, once: get_device_properties is then plain Python a compiled function can trace.
_HOST_CORES = os.cpu_count() or 1


def _sets_current_device(api: str) -> Callable[[F], F]:
    # Dynamo has torch.accelerator's device setter marked as skipped: traced, it failed with
    # Dynamo's generic message.
    return outside_compiled_graphs(api, "current device")


def _index(device: _device_t = None) -> int:
    """Device index of ``device``; the current device for None."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"Expected a tpu device, got {device}")
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    return _backend.topology is not None and device_count() > 0


def device_count() -> int:
    return 0 if _backend.topology is None else _backend.topology.num_devices


def current_device() -> int:
    return torch.accelerator.current_device_index()


@_sets_current_device("torch.tpu.set_device")
def set_device(device: _device_t) -> None:
    torch.accelerator.set_device_index(_index(device))


def synchronize(device: _device_t = None) -> None:
    """Runs DeferAndFuse's pending graph, then waits for all work queued on every stream of the device."""
    eager.materialize_deferred("torch.tpu.synchronize")
    torch.accelerator.synchronize(_index(device))


def mark_step() -> None:
    """The end of a training step, as PyTorch/XLA's ``xm.mark_step()``: under DeferAndFuse
    the pending graph runs here, a host boundary from which a step's segments can run
    dormant (torch_tpu.defer_segments); in Strict and Debug, nothing. Unlike
    ``synchronize`` it waits for no stream, so queued work keeps overlapping."""
    eager.materialize_deferred("torch.tpu.mark_step")


def is_initialized() -> bool:
    return _backend.topology is not None


def init() -> None:
    """The device initializes on import; kept for torch.cuda parity."""


def _is_in_bad_fork() -> bool:
    return False


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


class device:
    """Context manager that changes the current tpu device."""

    def __init__(self, device: Any):
        self.idx = _index(device) if device is not None else -1
        self.prev_idx = -1

    @_sets_current_device("torch.tpu.device")
    def __enter__(self) -> None:
        if self.idx >= 0:
            self.prev_idx = current_device()
            set_device(self.idx)

    @_sets_current_device("torch.tpu.device")
    def __exit__(self, *exc: object) -> None:
        if self.idx >= 0:
            set_device(self.prev_idx)


class device_of(device):
    """Context manager that makes the tensor's device current."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.device.type == "tpu" else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuDeviceProperties:
    """What ``torch.tpu.get_device_properties`` reports."""

    name: str
    """Device name, e.g. ``"TPU v5p (emulated)"``."""
    chip: str
    """Chip profile, e.g. ``"v5p"``."""
    total_memory: int
    """Emulated HBM capacity in bytes (what allocations are checked against)."""
    chip_hbm_bytes: int
    """The real chip's HBM in bytes."""
    hbm_capped: bool
    """True when total_memory is below the chip's HBM because of the host."""
    sparsecores_per_chip: int
    """SparseCores per chip, e.g. ``4``."""
    hbm_gbps: float
    """The chip's HBM bandwidth in GB/s."""
    bf16_tflops: float
    """The chip's peak bf16 TFLOP/s."""
    multi_processor_count: int
    """Host cores that run the emulated kernels (Inductor asks for it)."""
    emulated: bool = True
    """Always True: tensors live in host memory, kernels run on the CPU."""


def _checked_index(device: _device_t = None) -> int:
    idx = _index(device)
    if not 0 <= idx < device_count():
        raise ValueError(f"Invalid tpu device index {idx}: valid indices are 0..{device_count() - 1}")
    return idx


def get_device_properties(device: _device_t = None) -> TpuDeviceProperties:
    idx = _checked_index(device)
    topo = _backend.topology
    return TpuDeviceProperties(
        name=get_device_name(idx),
        chip=topo.chip.name,
        # What _configure set the allocator's capacity to at load, read without calling an op:
        # a compiled function traces this query (the op's int result failed in Dynamo).
        total_memory=topo.hbm_bytes,
        chip_hbm_bytes=topo.chip.hbm_bytes,
        hbm_capped=topo.hbm_capped,
        sparsecores_per_chip=topo.chip.sparsecores_per_chip,
        hbm_gbps=topo.chip.hbm_gbps,
        bf16_tflops=topo.chip.bf16_tflops,
        multi_processor_count=_HOST_CORES,
    )


def get_device_name(device: _device_t = None) -> str:
    _checked_index(device)
    return f"TPU {_backend.topology.chip.name} (emulated)"


def get_device_capability(device: _device_t = None) -> tuple[int, int]:
    return (0, 0)
